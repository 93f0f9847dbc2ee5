"""S3 fixtures (loaded from tests/conftest.py): one SeaweedFS server per session, a fresh bucket per
test with the AWS_* variables pointing at it, and a fault-injecting proxy in front of it.

- ``s3_server``: a running ``tests.s3server.SeaweedFS`` (skipped when ``weed`` is not installed,
  unless SAFEPOINT_REQUIRE_S3=1, as in CI, where that is a failure).
- ``s3_bucket``: one bucket for the session (SeaweedFS gives every bucket volumes of its own).
- ``s3_env``: the standard AWS variables set for the test (endpoint, keys, region), ~/.aws and
  instance metadata kept out, and a prefix of the session's bucket unique to the test; yields
  an ``S3Env``.
- ``fault_proxy``: a ``tests.faultproxy.FaultProxy`` in front of the session's server.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import pytest

from tests.faultproxy import FaultProxy
from tests.s3server import SeaweedFS, weed_binary


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    try:
        weed_binary()
    except RuntimeError as e:
        if os.environ.get("SAFEPOINT_REQUIRE_S3") == "1":
            pytest.fail(str(e))
        pytest.skip(str(e))
    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture(scope="session")
def s3_bucket(s3_server) -> str:
    """One bucket for the session (each bucket costs SeaweedFS volumes); tests use their own prefixes."""
    return s3_server.make_bucket()


@dataclass
class S3Env:
    server: SeaweedFS
    bucket: str
    prefix: str  # unique to the test

    def url(self, sub: str = "ckpt") -> str:
        return f"s3://{self.bucket}/{self.prefix}/{sub}"

    def key(self, sub: str) -> str:
        return f"{self.prefix}/{sub}"


@pytest.fixture
def s3_env(s3_server, s3_bucket, monkeypatch, tmp_path):
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return S3Env(s3_server, s3_bucket, f"t-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def fault_proxy(s3_server):
    with FaultProxy(s3_server.endpoint) as proxy:
        yield proxy
