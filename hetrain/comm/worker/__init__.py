"""The worker side of push_pull, in parts; the engine itself (`PushPull`) is comm/engine.py.

- `step.py`: one exchange's book-keeping (`_Step`, who owns it: `ExchangeOwner`), this
  worker's weighting (`weigh`, `_LazyScale`: b_i / Σb, or the servers weight it) and the
  step summary's accounting (`CommStats`);
- `layouts.py`: the layout the workers agreed on (`LayoutKeeper`): the tensors'
  description, the layouts kept by digest (comm/known.py), the bucket tuner, gradient homes;
- `stagings.py`: which staging a device's tensors take for this worker's transport
  (`staging_for`: host or CUDA, direct or work buffer, gloo or NCCL).
"""
