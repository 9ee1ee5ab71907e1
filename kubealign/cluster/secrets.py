"""The keys kubealign reads from the Kubernetes Secrets named in config.kubernetes, as environment
variables of every task pod (pipelines/dag.py) and every TrainJob node (cluster/trainjob.py). All are
optional: a Secret holds the ones its installation needs."""

MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
OBJECT_STORE_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_S3_ENDPOINT_URL")
