"""A progress bar that waits for its reader: after the first update it blocks until the
file named by argv[1] exists. Under a launcher that forwards output only by lines, the
reader never sees the update (the bar ends its line only when it closes), so the file
never appears and this script gives up with exit code 1."""
import os
import sys
import time

from tqdm import tqdm

import hetrain

hetrain.init()
go = sys.argv[1]
bar = tqdm(total=3, desc="progress", file=sys.stdout, ascii=True, mininterval=0)
bar.update(1)
deadline = time.monotonic() + 120
while not os.path.exists(go):
    if time.monotonic() > deadline:
        print("\nnobody saw the bar move", flush=True)
        sys.exit(1)
    time.sleep(0.05)
bar.update(2)
bar.close()
print("done", flush=True)
hetrain.shutdown()
