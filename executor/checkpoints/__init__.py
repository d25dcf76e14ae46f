"""Checkpoint I/O: atomic, verified, resharding DCP checkpoints (`store`), read as data
(`read`), each rank's state as plain data (`state`), experts by name (`experts`), and the
launcher's checks of a folder before any rank starts (`guard`)."""
