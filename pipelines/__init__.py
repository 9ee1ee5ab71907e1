"""The KFP v2 DAG and its compile/submit/local-run glue (installed as kubealign.pipelines).

The DAG arrives with the Kubeflow pipeline issue; the package exists now so that its install location
(kubealign.pipelines, never a top-level `pipelines`) is fixed and tested from the start.
"""
