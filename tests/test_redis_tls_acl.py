"""Redis over TLS with an ACL user: every process, and the quotas of
``limits``, reach Redis through one ``rediss://user:password@`` URL; the
password never reaches a log line or a message. The user has the ACL that
docs/operations.md recommends: the deployment's keys and channels only, and
no dangerous command."""

import subprocess
import sys
from pathlib import Path

import pytest
from infergate.base.ports import free_port
from infergate.redis_server import RedisServer

from tests.helpers import Cluster, policy_yaml

PASSWORD = "s3cret-Redis-pass"


def make_certificates(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate for 127.0.0.1 that it signed."""
    ca_key, ca, key, csr, cert = (tmp / n for n in ("ca.key", "ca.pem", "r.key", "r.csr", "r.pem"))
    ext = tmp / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for cmd in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
         "-days", "1", "-subj", "/CN=infergate-test-ca"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
         "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "1", "-extfile", ext],
    ):  # fmt: skip
        subprocess.run(["openssl", *map(str, cmd)], check=True, capture_output=True)
    return ca, cert, key


@pytest.fixture
def tls_redis(tmp_path: Path):  # type: ignore[no-untyped-def]
    try:
        ca, cert, key = make_certificates(tmp_path)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("openssl is needed to make test certificates")
    tls_port = free_port()
    server = RedisServer(
        args=(
            "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
            "--user", "default", "off",
            "--user", "infergate", "on", ">" + PASSWORD,
            "~{infergate}:*", "&{infergate}:*", "+@all", "-@dangerous", "+info",
        )
    )  # fmt: skip
    try:
        server.start()
    except RuntimeError as exc:
        pytest.skip(f"this redis-server has no TLS: {exc}")
    url = f"rediss://infergate:{PASSWORD}@127.0.0.1:{tls_port}/0?ssl_ca_certs={ca}"
    try:
        yield url
    finally:
        server.close()


def test_the_stack_runs_on_tls_with_an_acl_user(tmp_path: Path, tls_redis: str) -> None:
    doc = policy_yaml(tiers={"paid": {"rate_limits": ["3/minute"]}})
    cluster = Cluster(tmp_path, tls_redis, doc, workers=1, metrics=True)
    try:
        statuses = [cluster.infer("paid", f"tls-{i}")[0] for i in range(4)]
        assert statuses == [200, 200, 200, 429]  # limits' counters live on the same Redis
    finally:
        cluster.stop()
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
    assert PASSWORD not in logs
    assert "NOPERM" not in logs  # the ACL the docs recommend lets every process do its work
    assert "redis.memory_unread" not in logs  # (INFO: the memory's high-water mark)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://user:pw-secret@127.0.0.1:6379/0", "must start with one of"),
        ("redis+sentinel://:pw-secret@/mymaster", "names at least one sentinel"),
        ("redis+sentinel://:pw-secret@h:26379/", "ends with the service name"),
        ("redis+sentinel://:pw-secret@h:x/mymaster", "port must be a number"),
        ("redis+sentinel://h/mymaster?socket_timeout=1&sentinel_password=pw-secret", "may not set"),
        ("rediss://:pw-secret@h/0?ssl_cert_reqs=bogus", "ssl_cert_reqs"),
        ("redis://u:pw-secret/x@h:1/0", "not valid"),
        ("redis://:pw-secret@127.0.0.1:1/zero", "the db must be a number"),
        ("rediss://:pw-secret@127.0.0.1:99999/0", "port (1-65535)"),
    ],
)
def test_an_unusable_redis_url_is_refused_with_a_message(url: str, says: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "infergate", "worker", "--redis-url", url],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 2
    assert says in out.stderr
    assert "pw-secret" not in out.stderr + out.stdout
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://u:p@tail-secret@127.0.0.1:6379/0", "redis://u:***@127.0.0.1:6379/0"),
        (
            "redis+sentinel://s1:26379/m/0?sentinel_password=pw-secret&x=1",
            "redis+sentinel://s1:26379/m/0?sentinel_password=***&x=1",
        ),
        ("redis://h:6379/0?password=pw-secret", "redis://h:6379/0?password=***"),
        ("redis://h:6379/0", "redis://h:6379/0"),
    ],
)
def test_redact_hides_every_password(url: str, shown: str) -> None:
    from infergate.base.queue.redis_url import redact

    assert redact(url) == shown
