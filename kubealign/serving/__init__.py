"""Serving a registry alias: the runtimes (runtimes), where a version's bytes are (location), the
KServe InferenceService (manifest, pure; service reads the registry for it), putting it in the cluster and
waiting for Ready (deploy), serving it here with vLLM (local, split for a canary), and the online judge's
parts (endpoints, identity, ask, judge) and what carries out its verdict (act). docs/serving.md."""
