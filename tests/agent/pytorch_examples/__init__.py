"""Models from pytorch/examples (BSD-3-Clause), written out as the examples define them,
so the monitor and replay tests run on the code a new user starts from."""
