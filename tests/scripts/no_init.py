"""A script that never calls hetrain.init(): it finishes, and the summation servers,
which would wait for it at the rendezvous, must be stopped."""
print("plain script done", flush=True)
