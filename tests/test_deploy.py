"""The deployment files agree with the code and with each other.

Dockerfile, compose.yaml and the Kubernetes manifests under deploy/kubernetes: every
YAML file parses; the kustomize base and the KEDA overlay, rendered here, pass the
Kubernetes 1.30 schemas (strict); every command line parses with the real CLI parser
and every INFERGATE_* variable is one of its flags; probes and scrapes point at ports
and paths the processes serve; selectors select; the policy they mount loads; each
compose worker has its own GPU. Nothing here builds an image or starts a container.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from infergate.main import build_parser
from infergate.policies import load_policy

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "compose.yaml"
K8S = ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"
KEDA = K8S / "keda"
TWO_MODELS = K8S / "two-models"
REDIS_SECRET = K8S / "redis-secret.example.yaml"
COMPOSE_PROMETHEUS = ROOT / "deploy" / "compose" / "prometheus.yml"

K8S_VERSION = "1.30.0"
DESIRED_WORKERS = "infergate_autoscale_desired_workers"
# Which Dockerfile target each image name is built from (the Dockerfile's header).
IMAGE_TARGETS = {"infergate": "slim", "infergate-worker": "worker"}
# Served by each role: the gateway on --port, every process on --metrics-port.
GATEWAY_PATHS = {"/healthz", "/readyz", "/v1/inference"}
METRICS_PATHS = {"/metrics", "/healthz", "/readyz"}
PROBE_PATHS = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}
EVERY_INTERFACE = {"0.0.0.0", "::"}
# Not flags, read by the code itself (base/tracing.py, base/logs.py).
INFERGATE_VARIABLES = {"INFERGATE_TRACING", "INFERGATE_LOG_LEVEL", "INFERGATE_LOG_FORMAT"}
# runtime.run's default shutdown grace (the dispatcher's); a worker's is its hang timeout + this.
SHUTDOWN_GRACE_S = 10.0
COMPOSE_DEFAULT_STOP_GRACE_S = 10.0


# -- reading the files -------------------------------------------------------------------


def yaml_files() -> list[Path]:
    return sorted([COMPOSE, *(ROOT / "deploy").rglob("*.yaml"), *(ROOT / "deploy").rglob("*.yml")])


def load_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@dataclass
class Stage:
    name: str
    parent: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def dockerfile_stages() -> dict[str, Stage]:
    """The Dockerfile's stages by name, each with its instructions (continuations joined,
    comments dropped)."""
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    logical, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else words[0]
            current = stages[name] = Stage(name, words[0])
        elif current is not None:
            current.instructions.append((keyword, rest))
    return stages


def stage_chain(stages: dict[str, Stage], target: str) -> list[Stage]:
    """The target and the stages it is built FROM, base first."""
    chain = []
    name: str | None = target
    while name in stages:
        chain.append(stages[name])
        name = stages[name].parent
    return chain[::-1]


def image_env(target: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for stage in stage_chain(dockerfile_stages(), target):
        for keyword, rest in stage.instructions:
            if keyword == "ENV":
                for word in rest.split():
                    name, eq, value = word.partition("=")
                    assert eq, f"Dockerfile: write ENV {name}=value (one form throughout)"
                    env[name] = value
    return env


def exec_form(target: str, keyword: str) -> list[str]:
    """The target's own ENTRYPOINT or CMD, which must be in exec (JSON) form."""
    stage = dockerfile_stages()[target]
    values = [rest for kw, rest in stage.instructions if kw == keyword]
    assert len(values) == 1, f"Dockerfile: stage {target} needs exactly one {keyword}"
    value = json.loads(values[0])
    assert isinstance(value, list), f"Dockerfile: {target}'s {keyword} must be a JSON list"
    return [str(v) for v in value]


def interpolate(text: str) -> str:
    """A compose value with ${VAR:-default} / ${VAR-default} set to its default."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m[1] or "", text)


def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return document


def render(directory: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize DIRECTORY` gives, for the features these manifests use:
    resources (files and directories), configMapGenerator with files and a fixed name,
    and `$patch: delete` patches. Anything else fails here until it is taught."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "configMapGenerator", "patches"}
    assert set(kustomization) <= known, (
        f"{directory}/kustomization.yaml uses {set(kustomization) - known}: "
        "teach tests/test_deploy.py's render() what it does"
    )
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        objects += render(path) if path.is_dir() else load_all(path)
    for generator in kustomization.get("configMapGenerator", []):
        assert set(generator) <= {"name", "files", "options", "behavior"}, generator
        if generator.get("behavior") == "replace":  # the base's ConfigMap of that name goes
            objects = [
                o
                for o in objects
                if (o["kind"], o["metadata"]["name"]) != ("ConfigMap", generator["name"])
            ]
        assert generator.get("options", {}).get("disableNameSuffixHash") is True, (
            f"ConfigMap {generator['name']}: a hashed name changes on every edit, so the "
            "mounted policy would never update in place"
        )
        data = {}
        for entry in generator["files"]:
            key, _, source = entry.rpartition("=")
            data[key or Path(source).name] = (directory / source).read_text()
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": generator["name"]},
                "data": data,
            }
        )
    for entry in kustomization.get("patches", []):
        patch = yaml.safe_load(entry["patch"]) if "patch" in entry else None
        if patch is None:
            patch = yaml.safe_load((directory / entry["path"]).read_text())
        assert patch.pop("$patch", None) == "delete", "render() knows only $patch: delete"
        gone = [o for o in objects if same_object(o, patch)]
        assert len(gone) == 1, f"{directory}: the patch deletes {len(gone)} objects"
        objects.remove(gone[0])
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys)), f"{directory}: duplicate objects {keys}"
    return objects


def same_object(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["apiVersion"], a["kind"], a["metadata"]["name"]) == (
        b["apiVersion"],
        b["kind"],
        b["metadata"]["name"],
    )


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


# -- the command lines -------------------------------------------------------------------


@dataclass
class Process:
    """One infergate container: where it is declared, its argv after `infergate`, its
    environment (the image's, then its own plain values) and its health checks as
    (kind, path, port)."""

    where: str
    argv: list[str]
    env: dict[str, str]
    own_env: list[str]
    checks: list[tuple[str, str, int]]

    @property
    def role(self) -> str:
        return self.argv[0]


def target_of(image: str) -> str:
    name = image.rsplit("/", 1)[-1].split(":", 1)[0]
    assert name in IMAGE_TARGETS, f"image {image}: not one of {sorted(IMAGE_TARGETS)}"
    return IMAGE_TARGETS[name]


def dockerfile_processes() -> list[Process]:
    processes = []
    for target in sorted(set(IMAGE_TARGETS.values())):
        entrypoint = exec_form(target, "ENTRYPOINT")
        assert entrypoint == ["infergate"], f"Dockerfile {target}: ENTRYPOINT {entrypoint}"
        argv = exec_form(target, "CMD")
        processes.append(Process(f"Dockerfile {target}", argv, image_env(target), [], []))
    return processes


def compose_processes() -> list[Process]:
    processes = []
    for name, service in compose()["services"].items():
        if "build" not in service:
            continue  # redis, prometheus
        target = service["build"]["target"]
        assert target_of(service["image"]) == target, f"compose {name}: image vs target"
        assert service.get("entrypoint") in (None, ["infergate"]), f"compose {name}"
        argv = service.get("command") or exec_form(target, "CMD")
        environment = service.get("environment", {})
        if isinstance(environment, list):
            environment = dict(e.split("=", 1) for e in environment)
        env = {**image_env(target), **{k: str(v) for k, v in environment.items()}}
        checks = []
        if "healthcheck" in service:
            test = " ".join(service["healthcheck"]["test"])
            urls = re.findall(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/[\w/.-]*)", test)
            assert len(urls) == 1, f"compose {name}: healthcheck {test!r} has no local URL"
            checks.append(("readinessProbe", urls[0][1], int(urls[0][0])))
        processes.append(Process(f"compose {name}", argv, env, list(environment), checks))
    return processes


def container_processes(objects: list[dict[str, Any]]) -> list[Process]:
    processes = []
    for deployment in of_kind(objects, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            where = f"Deployment {deployment['metadata']['name']} {container['name']}"
            target = target_of(container["image"])
            command = container.get("command")
            assert command in (None, ["infergate"]), f"{where}: command {command}"
            argv = container.get("args") or exec_form(target, "CMD")
            own = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
            env = {**image_env(target), **own}
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            checks = []
            for kind in PROBE_PATHS:
                if kind in container:
                    http = container[kind]["httpGet"]
                    port = http["port"]
                    checks.append((kind, http["path"], ports.get(port, port)))
            names = [e["name"] for e in container.get("env", [])]
            processes.append(Process(where, argv, env, names, checks))
    return processes


def every_process() -> list[Process]:
    return [
        *dockerfile_processes(),
        *compose_processes(),
        *container_processes(render(BASE)),
        *[
            p
            for p in container_processes(render(TWO_MODELS))
            if p.where.startswith(
                ("Deployment infergate-worker-large", "Deployment infergate-dispatcher-large")
            )
        ],
    ]


def parse(process: Process) -> argparse.Namespace:
    """Parse its argv as `infergate` would, with its environment in place of ours (the
    parser reads INFERGATE_* defaults when it is built)."""
    outside = {
        k: v for k, v in os.environ.items() if not k.startswith("INFERGATE_") and k != "REDIS_URL"
    }
    with mock.patch.dict(os.environ, {**outside, **process.env}, clear=True):
        try:
            return build_parser().parse_args(process.argv)
        except SystemExit:
            pytest.fail(f"{process.where}: `infergate {' '.join(process.argv)}` does not parse")
        except (TypeError, ValueError) as exc:
            pytest.fail(f"{process.where}: an INFERGATE_* value does not convert: {exc}")


def flags_of(command: str) -> set[str]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices[command]
            return {s for a in sub._actions for s in a.option_strings}
    raise AssertionError("no subcommands")


def variable_flag(name: str) -> str:
    return "--" + name.removeprefix("INFERGATE_").lower().replace("_", "-")


def served(args: argparse.Namespace) -> dict[int, set[str]]:
    ports: dict[int, set[str]] = {}
    if args.command == "gateway":
        ports[args.port] = set(GATEWAY_PATHS)
    if args.metrics_port:
        assert args.metrics_port not in ports, "the metrics port is the gateway's port"
        ports[args.metrics_port] = set(METRICS_PATHS)
    return ports


def seconds(duration: str | int | float) -> float:
    """A compose duration (30s, 1m30s, 500ms) in seconds."""
    if isinstance(duration, int | float):
        return float(duration)
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?", duration)
    assert duration, "an empty duration"
    assert parts, f"not a duration: {duration!r}"
    h, m, s, ms = (int(p or 0) for p in parts.groups())
    return h * 3600 + m * 60 + s + ms / 1000


def policy_hang_timeout_s(text: str) -> float:
    return float(yaml.safe_load(text).get("workers", {}).get("hang_timeout_ms", 2000)) / 1000


# -- (a) everything parses ---------------------------------------------------------------


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_file_parses(path: Path) -> None:
    assert load_all(path), f"{path}: no document"


def image_uid(target: str) -> int:
    users = [rest for kw, rest in dockerfile_stages()[target].instructions if kw == "USER"]
    assert users, f"Dockerfile {target}: no USER (it would run as root)"
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), f"Dockerfile {target}: USER {uid}: numeric, so runAsNonRoot can check it"
    return int(uid)


def test_the_dockerfile_has_a_slim_and_a_worker_target_and_runs_as_a_user() -> None:
    for target in IMAGE_TARGETS.values():
        assert image_uid(target) != 0, f"Dockerfile {target}: USER root"
    assert next(reversed(dockerfile_stages())) == "slim", "the default target: the slim image"


def test_only_the_worker_image_installs_torch() -> None:
    stages = dockerfile_stages()

    def runs(target: str) -> str:
        """Every RUN of the target's chain and of the stages it copies from."""
        text = ""
        for stage in stage_chain(stages, target):
            for keyword, rest in stage.instructions:
                if keyword == "RUN":
                    text += rest + "\n"
                copied = re.match(r"--from=(\S+)", rest) if keyword == "COPY" else None
                if copied:
                    text += runs(copied[1])
        return text

    assert "torch" not in runs("slim")
    assert ".[torch]" in runs("worker")


def test_the_image_copies_every_package_folder() -> None:
    """pyproject.toml maps folders onto `infergate`: `pip install .` needs all of them,
    and .dockerignore must let them in."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", "README.md"} | set(
        pyproject["tool"]["setuptools"]["package-dir"].values()
    )
    copied = set()
    for stage in dockerfile_stages().values():
        for keyword, rest in stage.instructions:
            if keyword == "COPY" and "--from=" not in rest:
                copied |= {w.rstrip("/") for w in rest.split()[:-1] if not w.startswith("--")}
    assert needed <= copied, f"Dockerfile: COPY {sorted(needed - copied)}"
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for name in needed:
        ignored = False
        for pattern in patterns:  # the last matching pattern decides
            negated = pattern.startswith("!")
            if fnmatch(name, pattern.removeprefix("!").rstrip("/")):
                ignored = not negated
        assert not ignored, f".dockerignore leaves {name} out of the build"


# -- (b) the Kubernetes objects are valid ------------------------------------------------


def kubernetes_objects() -> list[tuple[str, dict[str, Any]]]:
    """Every object to validate: the base, what the KEDA overlay adds except its CRD
    (no schema here: test_the_keda_overlay_replaces_the_hpa checks it), the example."""
    objects = [("base", o) for o in render(BASE)]
    objects += [
        ("keda", o)
        for o in render(KEDA)
        if not o["apiVersion"].startswith("keda.sh/")
        and not any(same_object(o, b) for _, b in objects)
    ]
    objects += [
        ("two-models", o)
        for o in render(TWO_MODELS)
        if not any(same_object(o, b) for _, b in objects)
    ]
    return objects + [("example", o) for o in load_all(REDIS_SECRET)]


def test_every_kubernetes_object_passes_the_schema() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    problems = []
    for where, obj in kubernetes_objects():
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(
                f"{where}: {obj['kind']}/{obj['metadata']['name']}: {path}: {exc.message}"
            )
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("directory", [BASE, KEDA, TWO_MODELS], ids=["base", "keda", "two-models"])
def test_render_matches_kubectl_kustomize(directory: Path) -> None:
    done = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr

    def canonical(objects: list[dict[str, Any]]) -> list[str]:
        return sorted(json.dumps(o, sort_keys=True) for o in objects)

    assert canonical(render(directory)) == canonical(
        [o for o in yaml.safe_load_all(done.stdout) if o is not None]
    )


def test_the_keda_overlay_replaces_the_hpa() -> None:
    objects = render(KEDA)
    assert not of_kind(objects, "HorizontalPodAutoscaler"), "KEDA makes its own HPA"
    (scaled,) = of_kind(objects, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    ref = spec["scaleTargetRef"]
    assert ref.get("kind", "Deployment") == "Deployment"
    assert ref.get("apiVersion", "apps/v1") == "apps/v1"
    assert role_of(one(objects, "Deployment", ref["name"])) == "worker"
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["serverAddress"].startswith("http")
    assert re.fullmatch(rf"max\({DESIRED_WORKERS}(\{{.*\}})?\)", trigger["metadata"]["query"])
    assert trigger["metadata"]["threshold"] == "1"
    assert trigger.get("metricType", "AverageValue") == "AverageValue"
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    hpa = one(render(BASE), "HorizontalPodAutoscaler", "infergate-worker")
    assert behavior == hpa["spec"]["behavior"], "KEDA should scale as the base's HPA does"


# -- (c) command lines and variables -----------------------------------------------------


def test_every_command_line_parses_with_the_real_cli() -> None:
    for process in every_process():
        assert process.role in {"gateway", "dispatcher", "worker"}, process.where
        parse(process)


def test_every_infergate_variable_is_a_flag() -> None:
    any_flags = set().union(*(flags_of(c) for c in ("up", "gateway", "dispatcher", "worker")))
    for process in every_process():
        for name in process.env:
            if not name.startswith("INFERGATE_") or name in INFERGATE_VARIABLES:
                continue
            # The image's variables serve every role; a container's own must be its role's.
            flags = flags_of(process.role) if name in process.own_env else any_flags
            assert variable_flag(name) in flags, f"{process.where}: {name} is no flag"


# -- (d) probes, ports, scrapes and selectors --------------------------------------------


def test_health_checks_ask_what_the_processes_serve() -> None:
    for process in [*compose_processes(), *container_processes(render(BASE))]:
        check_health_checks(process)


def check_health_checks(process: Process) -> None:
    args = parse(process)
    ports = served(args)
    assert process.checks, f"{process.where}: no health check"
    for kind, path, port in process.checks:
        assert port in ports, f"{process.where}: {kind} on port {port}; it serves {ports}"
        assert path in ports[port], f"{process.where}: {kind} {path} is not served on {port}"
        if process.where.startswith("Deployment"):
            assert path == PROBE_PATHS[kind], (
                f"{process.where}: {kind} should ask {PROBE_PATHS[kind]}"
            )
    if args.command == "gateway":
        assert args.host in EVERY_INTERFACE, f"{process.where}: --host {args.host}"
    if args.metrics_port:
        assert args.metrics_host in EVERY_INTERFACE, (
            f"{process.where}: --metrics-host {args.metrics_host}: Prometheus cannot reach it"
        )


def role_of(deployment: dict[str, Any]) -> str:
    (process,) = container_processes([deployment])
    return process.role


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are checked here"
    match: dict[str, str] = selector["matchLabels"]
    return match.items() <= labels.items()


def test_deployments_probe_and_expose_their_real_ports() -> None:
    objects = render(BASE)
    roles = {role_of(d) for d in of_kind(objects, "Deployment")}
    assert roles == {"gateway", "dispatcher", "worker"}
    for deployment in of_kind(objects, "Deployment"):
        name = deployment["metadata"]["name"]
        template = deployment["spec"]["template"]
        assert selects(deployment["spec"]["selector"], template["metadata"]["labels"]), name
        (container,) = template["spec"]["containers"]
        (process,) = container_processes([deployment])
        args = parse(process)
        ports = served(args)
        for port in container.get("ports", []):
            assert port["containerPort"] in ports, f"{name}: port {port} is not served"
        kinds = {kind for kind, _, _ in process.checks}
        assert {"livenessProbe", "readinessProbe"} <= kinds, f"{name}: probes {kinds}"
        if args.command == "worker":
            assert "startupProbe" in kinds, f"{name}: loading the model needs a startupProbe"
        annotations = template["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", name
        assert annotations.get("prometheus.io/port") == str(args.metrics_port), name
        assert annotations.get("prometheus.io/path", "/metrics") == "/metrics", name


def test_the_gateway_service_reaches_the_gateways() -> None:
    objects = render(BASE)
    (service,) = of_kind(objects, "Service")
    selector = {"matchLabels": service["spec"]["selector"]}
    targets = [
        d
        for d in of_kind(objects, "Deployment")
        if selects(selector, d["spec"]["template"]["metadata"]["labels"])
    ]
    assert [role_of(d) for d in targets] == ["gateway"]
    (container,) = targets[0]["spec"]["template"]["spec"]["containers"]
    (process,) = container_processes(targets)
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for port in service["spec"]["ports"]:
        target = named.get(port["targetPort"], port["targetPort"])
        assert target == parse(process).port, f"Service port {port} misses the gateway's --port"


def test_disruption_budgets_select_the_gateway_and_worker_pods() -> None:
    objects = render(BASE)
    covered = []
    for budget in of_kind(objects, "PodDisruptionBudget"):
        matched = [
            d
            for d in of_kind(objects, "Deployment")
            if selects(budget["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(matched) == 1, f"PDB {budget['metadata']['name']} selects {len(matched)}"
        covered.append(role_of(matched[0]))
    assert sorted(covered) == ["gateway", "worker"]


def test_the_worker_hpa_follows_the_desired_worker_count() -> None:
    objects = render(BASE)
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    spec = hpa["spec"]
    ref = spec["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
    worker = one(objects, "Deployment", ref["name"])
    assert role_of(worker) == "worker"
    assert "replicas" not in worker["spec"], "the HPA owns the worker count"
    (metric,) = spec["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == DESIRED_WORKERS
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert spec["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]


def test_the_dispatcher_exports_the_metric_the_autoscalers_read() -> None:
    from infergate.base.metrics import DispatcherMetrics
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    DispatcherMetrics(registry)
    assert DESIRED_WORKERS in {m.name for m in registry.collect()}


def test_compose_prometheus_scrapes_every_process_and_loads_the_alerts() -> None:
    config = yaml.safe_load(COMPOSE_PROMETHEUS.read_text())
    targets = set()
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets |= set(static["targets"])
    for process in compose_processes():
        service = process.where.removeprefix("compose ")
        port = parse(process).metrics_port
        assert port, f"compose {service}: no --metrics-port"
        assert f"{service}:{port}" in targets, f"compose {service}: Prometheus misses it"
    mounts = {}
    for volume in compose()["services"]["prometheus"]["volumes"]:
        source, _, rest = volume.partition(":")
        mounts[rest.split(":")[0]] = (ROOT / source).resolve()
    assert mounts["/etc/prometheus/prometheus.yml"] == COMPOSE_PROMETHEUS
    for rule_file in config["rule_files"]:
        assert mounts[rule_file] == ROOT / "deploy" / "prometheus" / "alerts.yml"


# -- (e) the policy and the secrets ------------------------------------------------------


def test_the_configmap_policy_loads(tmp_path: Path) -> None:
    configmap = one(render(BASE), "ConfigMap", "infergate-policy")
    for key, text in configmap["data"].items():
        (tmp_path / key).write_text(text)
        load_policy(tmp_path / key)


def test_the_compose_policy_loads() -> None:
    for process in compose_processes():
        service = compose()["services"][process.where.removeprefix("compose ")]
        args = parse(process)
        (mount,) = [v for v in service["volumes"] if v["target"] == args.policy]
        assert mount["type"] == "bind", process.where
        assert mount["read_only"] is True, process.where
        load_policy(ROOT / interpolate(mount["source"]))


def test_every_pod_reads_the_policy_from_the_live_configmap() -> None:
    objects = render(BASE)
    configmap = one(objects, "ConfigMap", "infergate-policy")
    for deployment in of_kind(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        (process,) = container_processes([deployment])
        policy = Path(parse(process).policy)
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == policy.parent]
        # A subPath mount is a copy: it never sees the ConfigMap change.
        assert "subPath" not in mount, f"{process.where}: subPath mounts do not update"
        assert volumes[mount["name"]]["configMap"]["name"] == configmap["metadata"]["name"]
        assert policy.name in configmap["data"], f"{process.where}: no {policy.name}"


def test_redis_url_comes_from_the_secret() -> None:
    (secret,) = load_all(REDIS_SECRET)
    for deployment in of_kind(render(BASE), "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            (env,) = [e for e in container["env"] if e["name"] == "REDIS_URL"]
            ref = env["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"]
            assert ref["key"] in secret["stringData"]
    redis_url = pytest.importorskip("infergate.base.queue.redis_url")
    redis_url.check(secret["stringData"]["url"])
    redis_url.check(compose()["x-infergate"]["environment"]["REDIS_URL"])


# -- (f) GPUs, shutdown and pod hygiene --------------------------------------------------


def test_each_compose_worker_reserves_its_own_gpu() -> None:
    services = compose()["services"]
    gpus = []
    for process in compose_processes():
        name = process.where.removeprefix("compose ")
        devices = (
            services[name].get("deploy", {}).get("resources", {}).get("reservations", {})
        ).get("devices", [])
        if process.role != "worker":
            assert not devices, f"compose {name} reserves a GPU"
            continue
        assert len(devices) == 1, f"compose {name}: {len(devices)} device reservations"
        (device,) = devices
        assert device["driver"] == "nvidia", name
        assert "count" not in device, f"compose {name}: device_ids, not count"
        assert len(device["device_ids"]) == 1, f"compose {name}: one GPU per worker"
        gpus.append(str(device["device_ids"][0]))
    assert gpus, "no compose worker"
    assert len(gpus) == len(set(gpus)), f"compose workers share GPUs: {gpus}"


def test_kubernetes_workers_take_one_gpu_each() -> None:
    for deployment in of_kind(render(BASE), "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        expected = 1 if role_of(deployment) == "worker" else None
        assert (gpus if gpus is None else int(gpus)) == expected, deployment["metadata"]["name"]


def grace_needed_s(process: Process, policy_text: str) -> float:
    """How long the process may take to stop after SIGTERM."""
    args = parse(process)
    if args.command == "gateway":
        return float(args.drain_timeout_s)
    if args.command == "worker":
        hang_s = args.hang_timeout_ms / 1000 if args.hang_timeout_ms else None
        return (hang_s or policy_hang_timeout_s(policy_text)) + SHUTDOWN_GRACE_S
    return SHUTDOWN_GRACE_S


def test_termination_grace_outlasts_the_drain() -> None:
    objects = render(BASE)
    policy_text = one(objects, "ConfigMap", "infergate-policy")["data"]["policy.yaml"]
    for deployment in of_kind(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        (process,) = container_processes([deployment])
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        sleep_s = (
            float(pre_stop["command"][1]) if pre_stop.get("command", [""])[0] == "sleep" else 0
        )
        needed = sleep_s + grace_needed_s(process, policy_text)
        assert pod["terminationGracePeriodSeconds"] > needed, f"{process.where}: {needed} s"
    for process in compose_processes():
        service = compose()["services"][process.where.removeprefix("compose ")]
        mount = next(v for v in service["volumes"] if v["target"] == parse(process).policy)
        text = (ROOT / interpolate(mount["source"])).read_text()
        grace = seconds(service.get("stop_grace_period", COMPOSE_DEFAULT_STOP_GRACE_S))
        assert grace > grace_needed_s(process, text), f"{process.where}: stop_grace_period"


def test_pods_run_unprivileged_with_requests_and_without_service_links() -> None:
    for deployment in of_kind(render(BASE), "Deployment"):
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        # Service links would set INFERGATE_* variables (flags!) for a Service named infergate-*.
        assert pod.get("enableServiceLinks") is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        for container in pod["containers"]:
            uid = image_uid(target_of(container["image"]))
            assert pod["securityContext"].get("runAsUser", uid) == uid, f"{name}: not the image's"
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name


def test_a_second_model_group_has_its_own_deployments_signal_and_policy(tmp_path: Path) -> None:
    objects = render(TWO_MODELS)
    configmap = one(objects, "ConfigMap", "infergate-policy")
    (tmp_path / "policy.yaml").write_text(configmap["data"]["policy.yaml"])
    assert list(load_policy(tmp_path / "policy.yaml").models) == ["default", "large"]
    large = [
        p
        for p in container_processes(objects)
        if p.where.startswith(
            ("Deployment infergate-worker-large", "Deployment infergate-dispatcher-large")
        )
    ]
    assert len(large) == 2
    assert all(parse(p).model_name == "large" for p in large)
    base = [p for p in container_processes(objects) if p.where not in {q.where for q in large}]
    assert all(getattr(parse(p), "model_name", "default") == "default" for p in base)
    # No Deployment's selector takes another's pods.
    selectors = [d["spec"]["selector"]["matchLabels"] for d in of_kind(objects, "Deployment")]
    for d in of_kind(objects, "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        chosen = [sel for sel in selectors if sel.items() <= labels.items()]
        assert chosen == [d["spec"]["selector"]["matchLabels"]], d["metadata"]["name"]
    # Each model's workers follow its own dispatchers' signal.
    for name, model in (("infergate-worker", "default"), ("infergate-worker-large", "large")):
        hpa = one(objects, "HorizontalPodAutoscaler", name)
        assert hpa["spec"]["scaleTargetRef"]["name"] == name
        (metric,) = hpa["spec"]["metrics"]
        assert metric["external"]["metric"]["selector"] == {"matchLabels": {"model": model}}
