"""The chart's production stores as real parts on 127.0.0.1 (tests/faults/test_production_stores.py): a throwaway
PostgreSQL cluster (Debian's `postgresql`, made with initdb and started with pg_ctl), moto's S3 server,
and the MLflow server's command as the chart renders it, with the Secrets filled in the way Kubernetes
fills them.

Every wait is bounded; everything listens on loopback ports picked by the OS; the cluster's directory is
removed when it stops.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.faults import free_port

PG_TIMEOUT_S = 120  # initdb and a start take 1-5 s; a busy 2-core machine may take much longer
PG_USER = "kubealign"
PG_DATABASE = "mlflow"


def pg_bin(tool: str) -> Path | None:
    """A PostgreSQL server program: on PATH, else in Debian's versioned directory (the newest), where the
    `postgresql` package puts it without linking it onto PATH."""
    found = shutil.which(tool)
    if found:
        return Path(found)
    dirs = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda d: int(re.sub(r"\D", "", d.parent.name) or 0))
    return next((d / tool for d in reversed(dirs) if (d / tool).exists()), None)


def ensure_postgresql() -> str | None:
    """None when initdb and pg_ctl are there (installing Debian's `postgresql` when root with apt-get
    can), else why not."""
    if pg_bin("initdb") and pg_bin("pg_ctl"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "PostgreSQL's initdb/pg_ctl are missing and apt-get cannot install `postgresql` here (not root)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env, timeout=600, check=False)
    install = subprocess.run(
        ["apt-get", "install", "-y", "-qq", "postgresql"], capture_output=True, text=True, env=env, timeout=900
    )
    if install.returncode != 0 or not pg_bin("initdb"):
        return f"apt-get could not install postgresql: {install.stderr.strip()[-300:]}"
    return None


class PostgresCluster:
    """A PostgreSQL cluster of its own: password auth on 127.0.0.1:port, no fsync, removed by stop().

    PostgreSQL refuses to run as root, so as root the cluster belongs to `nobody`."""

    def __init__(self) -> None:
        self.port = free_port()
        self.password = secrets.token_hex(12)
        self.dir = Path(tempfile.mkdtemp(prefix="kubealign-pg-"))
        self.data = self.dir / "data"
        self.owner = pwd.getpwnam("nobody") if os.geteuid() == 0 else None

    @property
    def uri(self) -> str:
        """What the chart's Secret holds: a SQLAlchemy URL, here with the driver SQLAlchemy picks itself."""
        return f"postgresql://{PG_USER}:{self.password}@127.0.0.1:{self.port}/{PG_DATABASE}"

    def _run(self, *argv: object) -> subprocess.CompletedProcess:
        command = [str(a) for a in argv]
        if self.owner is not None:
            command = ["runuser", "-u", self.owner.pw_name, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=PG_TIMEOUT_S, check=False)
        if done.returncode != 0:
            log = self.dir / "server.log"
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(command)}: {done.stdout[-800:]}{done.stderr[-800:]}{tail}")
        return done

    def start(self) -> PostgresCluster:
        pwfile = self.dir / "pw"
        pwfile.write_text(self.password + "\n")
        pwfile.chmod(0o600)
        if self.owner is not None:
            for path in (self.dir, pwfile):
                os.chown(path, self.owner.pw_uid, self.owner.pw_gid)
        self._run(
            pg_bin("initdb"),
            "-D",
            self.data,
            "-U",
            PG_USER,
            f"--pwfile={pwfile}",
            "--auth=scram-sha-256",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        )
        options = f"-h 127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off -c full_page_writes=off"
        self._run(
            pg_bin("pg_ctl"),
            "-D",
            self.data,
            "-l",
            self.dir / "server.log",
            "-w",
            "-t",
            PG_TIMEOUT_S,
            "-o",
            options,
            "start",
        )
        import psycopg

        with psycopg.connect(self.admin_uri("postgres"), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f"CREATE DATABASE {PG_DATABASE}")
        return self

    def admin_uri(self, database: str = PG_DATABASE) -> str:
        """A libpq URI (psycopg's form, without SQLAlchemy's driver suffix)."""
        return f"postgresql://{PG_USER}:{self.password}@127.0.0.1:{self.port}/{database}"

    def query(self, sql: str) -> list[tuple]:
        import psycopg

        with psycopg.connect(self.admin_uri(), connect_timeout=10) as conn:
            return conn.execute(sql).fetchall()

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self._run(pg_bin("pg_ctl"), "-D", self.data, "-m", "immediate", "-w", "-t", 60, "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


class S3Server:
    """moto's S3 server (the emulator MLflow's own tests use) on 127.0.0.1, with one bucket."""

    ACCESS_KEY = "kubealign-test"
    SECRET_KEY = "kubealign-test-secret"

    def __init__(self, bucket: str) -> None:
        from moto.server import ThreadedMotoServer

        self.bucket = bucket
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.url = ""

    def start(self) -> S3Server:
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def client(self):
        import boto3
        from botocore.config import Config

        config = Config(connect_timeout=10, read_timeout=30, retries={"max_attempts": 2})
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=self.ACCESS_KEY,
            aws_secret_access_key=self.SECRET_KEY,
            region_name="us-east-1",
            config=config,
        )

    def object_keys(self) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def stop(self) -> None:
        self._server.stop()


def container_env(container: dict, secrets_: dict[tuple[str, str], str], values: dict[str, str]) -> dict[str, str]:
    """A rendered container's environment as Kubernetes gives it: `value`s as rendered (or the host-specific
    value for the names in `values`), `secretKeyRef`s looked up in `secrets_` by (Secret, key)."""
    env = {}
    for entry in container.get("env", []):
        if "valueFrom" in entry:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secrets_[(ref["name"], ref["key"])]
        else:
            env[entry["name"]] = values.get(entry["name"], entry["value"])
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of command and args from the container's env (unknown ones stay)."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg) for arg in args]


def process_env(container_vars: dict[str, str]) -> dict[str, str]:
    """This process's environment without MLflow/AWS settings of its own, plus the container's."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_"))}
    return {**base, **container_vars}


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise TimeoutError(f"{what} not within {timeout_s} s")
