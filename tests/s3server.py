"""moto's S3 server on 127.0.0.1 (a real S3 API over HTTP; objects kept in its memory, so keep test blobs small)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

BUCKET = "wb-test"
# fake credentials, and no lookups of a metadata service or the caller's ~/.aws
CLIENT_ENV = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class S3Server:
    """A running moto_server: ``url`` (http://127.0.0.1:PORT), bucket ``BUCKET`` made."""

    proc: subprocess.Popen
    url: str
    bucket: str = BUCKET

    @property
    def env(self) -> dict[str, str]:
        """What a process sets to reach it (credentials; the endpoint warmbox reads from WARMBOX_S3_ENDPOINT)."""
        return {**CLIENT_ENV, "WARMBOX_S3_ENDPOINT": self.url}

    @classmethod
    def start(cls, timeout: float = 30.0) -> S3Server:
        port = free_port()
        moto = Path(sys.executable).parent / "moto_server"
        proc = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(port)],
            env={**os.environ, **CLIENT_ENV},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        server = cls(proc, f"http://127.0.0.1:{port}")
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError as e:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError(f"moto_server did not start (exit {proc.poll()})") from e
                    time.sleep(0.1)
            server.client().create_bucket(Bucket=server.bucket)
        except BaseException:
            server.stop()
            raise
        return server

    def client(self):
        """A boto3 S3 client for it (credentials passed, not read from the environment)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=CLIENT_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CLIENT_ENV["AWS_SECRET_ACCESS_KEY"],
        )

    def keys(self, prefix: str) -> list[str]:
        """Every object key under ``prefix`` (paged; bounded by the test's own small data)."""
        out: list[str] = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out.extend(o["Key"] for o in page.get("Contents", []))
        return out

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL after 10 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
