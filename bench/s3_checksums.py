"""Probe: which S3 integrity features a store honours (SeaweedFS by default), as a table.

    python bench/s3_checksums.py                      # starts SeaweedFS (tests/s3server.py) on loopback
    python bench/s3_checksums.py --endpoint URL       # any S3 endpoint (AWS_* credentials, bucket created)

For each feature: does the store refuse a wrong value (it verifies what arrives), and does it give
the value back (HeadObject with ChecksumMode=ENABLED, GetObjectAttributes), for a single PUT and
for a multipart upload? Safepoint counts a replica as attested by the store (no read-back) only
where the store refuses a wrong value and returns the right one (safepoint/destinations/s3.py).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import sys
import tempfile
import uuid
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 2**20


def b64(d: bytes) -> str:
    return base64.b64encode(d).decode()


def sha256(b: bytes) -> str:
    return b64(hashlib.sha256(b).digest())


def crc32(b: bytes) -> str:
    return b64(zlib.crc32(b).to_bytes(4, "big"))


def md5(b: bytes) -> str:
    return b64(hashlib.md5(b).digest())


def refused(fn: Any) -> str:
    """'refused (CODE)' when the call fails, 'accepted' when it does not."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - any refusal is the answer
        code = getattr(e, "response", {}).get("Error", {}).get("Code") or type(e).__name__
        return f"refused ({code})"
    return "ACCEPTED"


def probe(c: Any, bucket: str) -> list[tuple[str, str]]:
    rows = []
    body = os.urandom(64 * 1024)
    k = f"probe-{uuid.uuid4().hex[:8]}"

    rows.append(("PUT, wrong x-amz-checksum-sha256", refused(
        lambda: c.put_object(Bucket=bucket, Key=k + "-bad", Body=body, ChecksumSHA256=sha256(b"other")))))
    rows.append(("PUT, wrong x-amz-checksum-crc32", refused(
        lambda: c.put_object(Bucket=bucket, Key=k + "-bad", Body=body, ChecksumCRC32=crc32(b"other")))))
    rows.append(("PUT, wrong Content-MD5", refused(
        lambda: c.put_object(Bucket=bucket, Key=k + "-bad", Body=body, ContentMD5=md5(b"other")))))
    c.put_object(Bucket=bucket, Key=k, Body=body, ChecksumSHA256=sha256(body))
    h = c.head_object(Bucket=bucket, Key=k, ChecksumMode="ENABLED")
    rows.append(("PUT with sha256, HEAD returns it", "yes" if h.get("ChecksumSHA256") == sha256(body)
                 else f"no ({h.get('ChecksumSHA256')!r})"))
    c.put_object(Bucket=bucket, Key=k + "-plain", Body=body)
    h = c.head_object(Bucket=bucket, Key=k + "-plain", ChecksumMode="ENABLED")
    got = {x: h[x] for x in h if x.startswith("Checksum") and x != "ChecksumType"}
    rows.append(("plain PUT, HEAD returns a checksum of its own", f"{got or 'none'} {h.get('ChecksumType', '')}"))
    try:
        a = c.get_object_attributes(Bucket=bucket, Key=k, ObjectAttributes=["Checksum", "ObjectSize", "ETag"])
        rows.append(("GetObjectAttributes Checksum", str(a.get("Checksum"))))
    except Exception as e:  # noqa: BLE001
        rows.append(("GetObjectAttributes", f"fails ({type(e).__name__}: {str(e)[:80]})"))

    # multipart: 2 parts of 5 MiB, SHA-256 per part
    parts = [os.urandom(5 * MiB), os.urandom(1 * MiB)]
    km = k + "-mp"
    up = c.create_multipart_upload(Bucket=bucket, Key=km, ChecksumAlgorithm="SHA256")["UploadId"]
    rows.append(("UploadPart, wrong x-amz-checksum-sha256", refused(
        lambda: c.upload_part(Bucket=bucket, Key=km, UploadId=up, PartNumber=1, Body=parts[0],
                              ChecksumSHA256=sha256(b"other")))))
    rows.append(("UploadPart, wrong Content-MD5", refused(
        lambda: c.upload_part(Bucket=bucket, Key=km, UploadId=up, PartNumber=1, Body=parts[0],
                              ContentMD5=md5(b"other")))))
    done = []
    for n, p in enumerate(parts, 1):
        r = c.upload_part(Bucket=bucket, Key=km, UploadId=up, PartNumber=n, Body=p, ChecksumSHA256=sha256(p))
        rows.append((f"UploadPart {n} answers x-amz-checksum-sha256", "yes" if r.get("ChecksumSHA256") == sha256(p)
                     else f"no ({r.get('ChecksumSHA256')!r})"))
        done.append({"PartNumber": n, "ETag": r["ETag"], "ChecksumSHA256": sha256(p)})
    up2 = c.create_multipart_upload(Bucket=bucket, Key=km + "-x", ChecksumAlgorithm="SHA256")["UploadId"]
    r = c.upload_part(Bucket=bucket, Key=km + "-x", UploadId=up2, PartNumber=1, Body=parts[1],
                      ChecksumSHA256=sha256(parts[1]))
    rows.append(("CompleteMultipartUpload, the part's sha256 given wrong", refused(
        lambda: c.complete_multipart_upload(Bucket=bucket, Key=km + "-x", UploadId=up2, MultipartUpload={"Parts": [
            {"PartNumber": 1, "ETag": r["ETag"], "ChecksumSHA256": sha256(b"other")}]}))))
    c.complete_multipart_upload(Bucket=bucket, Key=km, UploadId=up, MultipartUpload={"Parts": done})
    composite = b64(hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in parts)).digest()) + f"-{len(parts)}"
    h = c.head_object(Bucket=bucket, Key=km, ChecksumMode="ENABLED")
    rows.append(("multipart, HEAD returns the composite sha256", "yes" if h.get("ChecksumSHA256") == composite
                 else f"no ({h.get('ChecksumSHA256')!r}, expected {composite!r}; type {h.get('ChecksumType')})"))
    try:
        a = c.get_object_attributes(Bucket=bucket, Key=km, ObjectAttributes=["Checksum", "ObjectParts"])
        rows.append(("multipart, GetObjectAttributes", f"Checksum {a.get('Checksum')}, "
                     f"{len((a.get('ObjectParts') or {}).get('Parts') or [])} parts listed"))
    except Exception as e:  # noqa: BLE001
        rows.append(("multipart, GetObjectAttributes", f"fails ({type(e).__name__}: {str(e)[:80]})"))
    kc = k + "-mp-crc32"
    up4 = c.create_multipart_upload(Bucket=bucket, Key=kc, ChecksumAlgorithm="CRC32")["UploadId"]
    rows.append(("UploadPart, wrong x-amz-checksum-crc32", refused(
        lambda: c.upload_part(Bucket=bucket, Key=kc, UploadId=up4, PartNumber=1, Body=parts[0],
                              ChecksumCRC32=crc32(b"other")))))
    done = []
    for n, p in enumerate(parts, 1):
        r = c.upload_part(Bucket=bucket, Key=kc, UploadId=up4, PartNumber=n, Body=p, ChecksumCRC32=crc32(p))
        done.append({"PartNumber": n, "ETag": r["ETag"], "ChecksumCRC32": crc32(p)})
    c.complete_multipart_upload(Bucket=bucket, Key=kc, UploadId=up4, MultipartUpload={"Parts": done})
    joined = b"".join(zlib.crc32(p).to_bytes(4, "big") for p in parts)
    composite = crc32(joined) + f"-{len(parts)}"
    h = c.head_object(Bucket=bucket, Key=kc, ChecksumMode="ENABLED")
    rows.append(("multipart crc32, HEAD returns the composite crc32", "yes" if h.get("ChecksumCRC32") == composite
                 else f"no ({h.get('ChecksumCRC32')!r}, expected {composite!r})"))
    kp = k + "-mp-plain"
    up3 = c.create_multipart_upload(Bucket=bucket, Key=kp)["UploadId"]
    r = c.upload_part(Bucket=bucket, Key=kp, UploadId=up3, PartNumber=1, Body=parts[1])
    c.complete_multipart_upload(Bucket=bucket, Key=kp, UploadId=up3,
                                MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": r["ETag"]}]})
    h = c.head_object(Bucket=bucket, Key=kp, ChecksumMode="ENABLED")
    got = {x: h[x] for x in h if x.startswith("Checksum") and x != "ChecksumType"}
    rows.append(("plain multipart, HEAD returns a checksum of its own", f"{got or 'none'}"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint")
    ap.add_argument("--bucket", default="probe")
    a = ap.parse_args()
    if a.endpoint:
        import boto3

        c = boto3.client("s3", endpoint_url=a.endpoint)
        rows = probe(c, a.bucket)
    else:
        from tests.s3server import SeaweedFS, weed_binary

        with tempfile.TemporaryDirectory() as d, SeaweedFS(d) as server:
            server.make_bucket(a.bucket)
            rows = probe(server.client(), a.bucket)
            import subprocess

            print("store:", subprocess.run([weed_binary(), "version"], capture_output=True, text=True).stdout.strip())
    import botocore

    print(f"client: botocore {botocore.__version__}")
    print("| probe | answer |\n| --- | --- |")
    for name, answer in rows:
        print(f"| {name} | {answer} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
