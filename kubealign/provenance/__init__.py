"""What a registered version is made of and how to check it: its files' digests (digests), the manifest that
records its recipe (manifest), written by promote, verified by serve, the serve task and feedback push, and
read back by `kubealign reproduce`."""
