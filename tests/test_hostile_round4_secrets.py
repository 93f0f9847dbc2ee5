"""Secrets anywhere in a URL (issue 37): userinfo, query and fragment are sealed before a URL reaches
Prefect, and masked before it reaches a log or the catalog.

A catalog URL `postgresql+psycopg://postgres@host/db?password=SECRET` used to reach Prefect's
database whole: only the userinfo was sealed. The unit tables say which parameters count as secrets
(safepoint.core.redact.is_secret_param); the last test greps a real Prefect server's files after an
ingest through the CLI, as tests/test_prefect_native.py does for userinfo.
"""

from __future__ import annotations

import json
import stat
import time
import uuid

import pytest

from safepoint.core.redact import MASK, is_secret_param, redact, without_secrets
from safepoint.local.credentials import REF_PREFIX, hide_credentials, hides_credentials, reveal_credentials
from tests.test_prefect_native import cli, client_env, flow_run_parameters, server, snapshot  # noqa: F401

PRESIGNED = ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAX%2F20260101"
             "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=60&X-Amz-SignedHeaders=host&X-Amz-Signature=f00d")


@pytest.mark.parametrize(("name", "secret"), [
    ("password", True), ("PASSWORD", True), ("sslpassword", True), ("passwd", True), ("pwd", True),
    ("secret", True), ("client_secret", True), ("aws_secret_access_key", True), ("token", True),
    ("access_token", True), ("X-Amz-Security-Token", True), ("X-Amz-Signature", True), ("X-Amz-Credential", True),
    ("X-Goog-Signature", True), ("X-Goog-Credential", True), ("sig", True), ("signature", True), ("key", True),
    ("api_key", True), ("apiKey", True), ("access_key", True), ("AccessKeyId", True), ("private_key", True),
    ("SharedAccessSignature", True), ("authorization", True), ("x%2Damz%2Dsignature", True),
    ("options", False), ("search_path", False), ("sslmode", False), ("application_name", False),
    ("X-Amz-Algorithm", False), ("X-Amz-Expires", False), ("X-Amz-Date", False), ("sv", False), ("se", False),
    ("authSource", False), ("authMechanism", False), ("region", False), ("uri", False), ("mode", False),
])
def test_which_url_parameters_are_secrets(name, secret):
    assert is_secret_param(name) is secret


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql+psycopg://postgres@127.0.0.1:5432/test?password=SECRET",
     f"postgresql+psycopg://127.0.0.1:5432/test?password={MASK}"),
    ("postgresql://h/db?options=-csearch_path%3Dx&sslpassword=SECRET&sslmode=require",
     f"postgresql://h/db?options=-csearch_path%3Dx&sslpassword={MASK}&sslmode=require"),
    ("https://app/cb#access_token=SECRET&state=3", f"https://app/cb#access_token={MASK}&state=3"),
    ("https://a.blob.core.windows.net/c/b?sv=2022&se=2026&sig=SECRET%2Bx", f"https://a.blob.core.windows.net/c/b?sv=2022&se=2026&sig={MASK}"),
    ("jdbc:x://h;user=u;password=SECRET", f"jdbc:x://h;user=u;password={MASK}"),
    ("s3://KEY:SECRET@bucket/p?versionId=3", "s3://bucket/p?versionId=3"),
    ("failed: GET https://h/k?X-Goog-Signature=SECRET&X-Goog-Date=1 (403)",
     f"failed: GET https://h/k?X-Goog-Signature={MASK}&X-Goog-Date=1 (403)"),
    ("mongodb://h/db?authSource=admin", "mongodb://h/db?authSource=admin"),
])
def test_redact_masks_secret_parameters_and_keeps_the_rest(url, shown):
    assert redact(url) == shown
    assert redact(shown) == shown  # idempotent
    assert "SECRET" not in redact(url)


@pytest.mark.parametrize(("url", "kept"), [
    ("postgresql+psycopg://postgres@127.0.0.1:5432/test?password=SECRET", "postgresql+psycopg://127.0.0.1:5432/test"),
    ("postgresql://u:SECRET@h/db?options=-csearch_path%3Dx&password=SECRET#token=SECRET",
     "postgresql://h/db?options=-csearch_path%3Dx"),
    (PRESIGNED, "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Date=20260101T000000Z"
                "&X-Amz-Expires=60&X-Amz-SignedHeaders=host"),
    ("https://app/cb#section", "https://app/cb#section"),
    ("file:///data/ckpt", "file:///data/ckpt"),
])
def test_without_secrets_leaves_out_userinfo_and_secret_parameters(url, kept):
    assert without_secrets(url) == kept


@pytest.mark.parametrize("url", [
    "postgresql+psycopg://postgres@127.0.0.1:5432/test?password=SECRET",
    "postgresql+psycopg://127.0.0.1:5432/test?options=-csearch_path%3Dx&password=SECRET",
    "sqlite:///tmp/c.db?token=SECRET",
    PRESIGNED.replace("f00d", "SECRET"),
    "https://app/cb#access_token=SECRET",
])
def test_a_secret_in_the_query_or_fragment_is_sealed_by_reference(url):
    sealed = hide_credentials(url)
    assert sealed is not None and "SECRET" not in sealed and REF_PREFIX in sealed and hides_credentials(sealed)
    assert reveal_credentials(sealed) == url  # the process that runs the flow reads it back
    # deterministic, and sealing a reference is a no-op
    assert hide_credentials(url) == sealed and hide_credentials(sealed) == sealed
    assert redact(sealed) == without_secrets(url)  # what logs and the catalog show
    if "options=" in url:
        assert "options=-csearch_path%3Dx" in sealed  # what is no secret stays in sight


@pytest.mark.parametrize("url", ["file:///data/ckpt", "s3://bucket/p", "https://h/k?versionId=3", "/data/c?token=x"])
def test_a_url_without_a_secret_is_left_alone(url):
    assert hide_credentials(url) == url


@pytest.mark.slow
@pytest.mark.s3
def test_a_password_in_the_query_never_reaches_prefects_database(client_env, postgres_catalog_url, tmp_path):  # noqa: F811
    prefect = client_env
    pg_password = f"pgQuery{uuid.uuid4().hex}"
    catalog = postgres_catalog_url + ("&" if "?" in postgres_catalog_url else "?") + f"password={pg_password}"
    home = tmp_path / "home"
    home.mkdir()
    durable = (tmp_path / "durable").as_uri()
    r = cli(prefect, home, "--catalog", catalog, "ingest", str(snapshot(tmp_path / "nvme", "qs", 1)),
            "--to", durable, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["state"] == "verified"
    assert pg_password not in r.stdout + r.stderr

    (params,) = [p for p in flow_run_parameters(prefect) if "snapshot" in p and p["snapshot"].endswith("/qs/s1")]
    assert params["catalog_url"].startswith(f"postgresql+psycopg://{REF_PREFIX}")
    assert "options=-csearch_path" in params["catalog_url"]  # the schema stays in sight: no secret
    sealed = [f for f in (home / "credentials").iterdir() if not f.name.startswith(".")]
    assert [f.read_text() for f in sealed] == [catalog]
    assert stat.S_IMODE(sealed[0].stat().st_mode) == 0o600

    time.sleep(3)  # events and logs reach the database a moment after the run ends
    seen_ref = False
    for f in (f for f in prefect.home.rglob("*") if f.is_file()):
        data = f.read_bytes()
        seen_ref = seen_ref or REF_PREFIX.encode() in data
        assert pg_password.encode() not in data, f"the password is in {f}"
    assert seen_ref  # the parameters were written to these files
