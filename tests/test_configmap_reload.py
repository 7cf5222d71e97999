"""The policy as a Kubernetes ConfigMap: the kubelet never edits a mounted
file; it writes a new timestamped folder, points ``..data`` at it with one
atomic rename of a symlink, and deletes the old folder. ``policy.yaml`` is a
symlink through ``..data``. Running processes must follow that swap."""

import os
import shutil
from pathlib import Path

from tests.helpers import Cluster, as_yaml, auth, http, policy, policy_yaml, wait_for


class ConfigMapMount:
    """A folder laid out as the kubelet's AtomicWriter lays out a ConfigMap volume."""

    def __init__(self, root: Path, text: str) -> None:
        self.root = root
        root.mkdir()
        self.generation = 0
        self.current = self._write_generation(text)
        os.symlink(self.current.name, root / "..data")
        os.symlink("..data/policy.yaml", root / "policy.yaml")
        self.path = root / "policy.yaml"

    def _write_generation(self, text: str) -> Path:
        self.generation += 1
        folder = self.root / f"..2026_11_26_12_00_0{self.generation}.{os.getpid()}"
        folder.mkdir()
        (folder / "policy.yaml").write_text(text)
        return folder

    def update(self, text: str) -> None:
        """What the kubelet does when the ConfigMap changes."""
        old_stat = (self.current / "policy.yaml").stat()
        new = self._write_generation(text)
        # The same mtime as the old file: a watcher must not rely on it changing.
        os.utime(new / "policy.yaml", ns=(old_stat.st_atime_ns, old_stat.st_mtime_ns))
        os.symlink(new.name, self.root / "..data_tmp")
        os.replace(self.root / "..data_tmp", self.root / "..data")
        shutil.rmtree(self.current)
        self.current = new


def policy_version(url: str) -> str:
    status, _, body = http("GET", url + "/v1/admin/policy", headers=auth("admin"))
    assert status == 200, body
    return str(body["version"])


def test_a_configmap_symlink_swap_reloads_the_policy(tmp_path: Path, redis_url: str) -> None:
    mount = ConfigMapMount(tmp_path / "policy-volume", policy_yaml())
    cluster = Cluster(tmp_path, redis_url, "", workers=1, policy_file=mount.path)
    try:
        first = policy_version(cluster.urls[0])
        assert cluster.infer("free", "before")[0] == 200
        # The new policy disables the free tier's key.
        doc = policy()
        for key in doc["keys"]:
            if key["id"] == "fre":
                key["disabled"] = True
        mount.update(as_yaml(doc))
        wait_for(lambda: policy_version(cluster.urls[0]) != first, 10, "the swap to be read")
        assert cluster.infer("free", "after")[0] == 403
        # An invalid ConfigMap changes nothing, and says why; a valid one applies again.
        mount.update("tiers: [not, a, mapping]\n")
        wait_for(
            lambda: http("GET", cluster.urls[0] + "/v1/admin/policy", headers=auth("admin"))[2][
                "error"
            ],
            10,
            "the invalid swap to be reported",
        )
        assert cluster.infer("free", "still off")[0] == 403
        mount.update(policy_yaml())
        wait_for(lambda: cluster.infer("free", "on again")[0] == 200, 10, "the key to be back")
    finally:
        cluster.stop()
