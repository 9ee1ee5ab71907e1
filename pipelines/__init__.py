"""The KFP v2 DAG and its glue (installed as kubealign.pipelines): dag (the @dsl.pipeline), local
(`kubealign run` through kfp.local), remote (`compile`, `submit`, `upload` through kfp.Client) and rerun
(`kubealign rerun`). See docs/pipeline.md."""
