"""The deployment recipes in deploy/: every Kubernetes manifest is valid against the API schemas (a real
validator, strict: unknown fields are errors), the manifests agree with each other, the shell scripts parse,
and every flag and FTHSDP_* variable they use exists."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# The oldest version the manifests target (Job backoffLimitPerIndex is GA in 1.33) and the newest the validator
# ships: a field dropped or made required in between shows up here.
K8S_VERSIONS = ("1.33", kubernetes_validate.utils.latest_version())


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return out


DOCS = _docs()


def _find(kind: str, name: str) -> dict[str, Any]:
    hits = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name} in deploy/k8s, found {len(hits)}"
    return hits[0]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    assert len(values) == 1, f"{name} given {len(values)} times in {args}"
    return values[0]


# --- schema validation ---------------------------------------------------------------------------------------


def test_manifests_found() -> None:
    kinds = {d["kind"] for _, d in DOCS}
    assert {"Namespace", "Secret", "Service", "StatefulSet", "Job", "PodDisruptionBudget"} <= kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name,doc", DOCS, ids=[n for n, _ in DOCS])
def test_manifest_is_valid(name: str, doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("break_it,why", [
    (lambda job: job["spec"]["template"]["spec"].update(restartPolicey="Never"), "unknown field (strict mode)"),
    (lambda job: job["spec"].update(completions="four"), "wrong type"),
    (lambda job: job["spec"]["template"]["spec"].pop("containers"), "required field missing"),
    (lambda job: job["spec"]["podFailurePolicy"]["rules"][0]["onPodConditions"][0].pop("status"),
     "required before Kubernetes 1.35"),
], ids=["unknown-field", "wrong-type", "missing-containers", "missing-status"])
def test_validator_rejects_a_broken_manifest(break_it: Any, why: str) -> None:
    """The validation above can fail: the same Job, broken one way, is rejected."""
    job = copy.deepcopy(_find("Job", "fthsdp-replicas"))
    kubernetes_validate.validate(job, K8S_VERSIONS[0], strict=True)  # intact: valid
    break_it(job)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSIONS[0], strict=True)


# --- the manifests agree with each other ---------------------------------------------------------------------


def test_replica_groups_are_an_indexed_job_that_restarts() -> None:
    job = _find("Job", "fthsdp-replicas")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # the API requires it with podFailurePolicy
    assert spec["backoffLimitPerIndex"] >= 1
    assert any(r["action"] == "Ignore" and r.get("onPodConditions", [{}])[0].get("type") == "DisruptionTarget"
               for r in spec["podFailurePolicy"]["rules"])
    trainer = _container(job, "trainer")
    env = _env(trainer)
    assert env["FTHSDP_REPLICA_INDEX"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert int(env["FTHSDP_NUM_REPLICAS"]) == spec["completions"]
    # torchrun restarts the workers in place: it must not share its rendezvous store (pytorch#135712).
    if int(_flag(trainer["args"], "--max-restarts")) > 0:
        assert env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"
    assert int(_flag(trainer["args"], "--nproc-per-node")) == int(trainer["resources"]["limits"]["nvidia.com/gpu"])
    # The lighthouse forms the first epoch once every group registered.
    lighthouse = _find("StatefulSet", "lighthouse")
    lh_args = _container(lighthouse, "lighthouse")["args"]
    assert int(_flag(lh_args, "--expected-replicas")) == spec["completions"]
    # A group that never registers holds the job's start no longer than this, below the trainers' epoch wait.
    assert 0 < float(_flag(lh_args, "--join-window")) < float(env["FTHSDP_EPOCH_WAIT"])
    # Replicas are given every lighthouse by the stable name each advertises as leader (and its certificate
    # names): lighthouse-N.<headless service>.fthsdp.svc:<grpc port>.
    svc = _find("Service", lighthouse["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    names = [f"lighthouse-{i}.{svc['metadata']['name']}.fthsdp.svc:{port}"
             for i in range(lighthouse["spec"]["replicas"])]
    assert env["FTHSDP_LIGHTHOUSE"].split(",") == names
    assert _flag(lh_args, "--advertise") == f"$(POD_NAME).{svc['metadata']['name']}.fthsdp.svc:{port}"


def test_lighthouse_has_two_replicas_on_the_three_member_etcd() -> None:
    lh = _find("StatefulSet", "lighthouse")
    assert lh["spec"]["replicas"] == 2
    etcd = _find("StatefulSet", "etcd")
    assert etcd["spec"]["replicas"] == 3
    headless = _find("Service", etcd["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    store = _flag(_container(lh, "lighthouse")["args"], "--store")
    assert store.startswith("etcd://")
    members = store[len("etcd://"):].split(",")
    assert members == [f"etcd-{i}.{headless['metadata']['name']}.fthsdp.svc:2379" for i in range(3)]
    args = _container(etcd, "etcd")["args"]
    assert _flag(args, "--initial-cluster").count("=https://") == 3  # peers over TLS (below)


def test_secrets_are_mounted_where_the_flags_point() -> None:
    secrets = {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == "Secret"}
    for kind, name, container, flags in (("StatefulSet", "lighthouse", "lighthouse",
                                          ("--tls-cert", "--tls-key", "--token-file", "--etcd-ca", "--etcd-cert",
                                           "--etcd-key")),
                                         ("StatefulSet", "etcd", "etcd",
                                          ("--cert-file", "--key-file", "--trusted-ca-file", "--peer-cert-file",
                                           "--peer-key-file", "--peer-trusted-ca-file")),
                                         ("Job", "fthsdp-replicas", "trainer", ())):
        doc = _find(kind, name)
        c = _container(doc, container)
        volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
        volumes |= {v["metadata"]["name"]: {"persistentVolumeClaim": v}
                    for v in doc["spec"].get("volumeClaimTemplates", [])}
        files = set()
        for mount in c["volumeMounts"]:
            secret = volumes[mount["name"]].get("secret")
            if secret is None:
                files |= _copied_by_init(doc, mount, secrets)
                continue
            assert secret["secretName"] in secrets, f"{name} mounts a Secret that is not defined"
            keys = set(secrets[secret["secretName"]]["stringData"])
            items = secret.get("items") or [{"key": k, "path": k} for k in keys]
            for item in items:
                assert item["key"] in keys
                files.add(f"{mount['mountPath']}/{item['path']}")
        wanted = [_flag(c["args"], f) for f in flags]
        wanted += [v for k, v in _env(c).items() if k in ("FTHSDP_TLS_CA", "FTHSDP_TOKEN_FILE")]
        assert wanted, f"{name}: neither TLS nor the job token is wired in"
        for path in wanted:
            assert path in files, f"{name}: {path} is not a mounted Secret file"


def _copied_by_init(doc: dict[str, Any], mount: dict[str, Any], secrets: dict[str, Any]) -> set[str]:
    """The files an init container copies from a mounted Secret into the volume ``mount`` names (a replica group's
    own credential: the trainer never mounts the Secret holding every group's), as the trainer sees them."""
    out = set()
    for init in doc["spec"]["template"]["spec"].get("initContainers", []):
        into = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        if mount["name"] not in into:
            continue
        script = " ".join(init["command"])
        m = re.search(r"cp (\S+) (\S+)", script)
        assert m, f"init container {init['name']}: no copy into {mount['name']}"
        source, dest = m.group(1), m.group(2)
        volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
        from_secret = next(volumes[n]["secret"]["secretName"] for n, p in into.items()
                           if source.startswith(p + "/") and "secret" in volumes[n])
        keys = secrets[from_secret]["stringData"]
        pattern = source.rsplit("/", 1)[1].replace("$(FTHSDP_REPLICA_INDEX)", "{}")
        assert all(pattern.format(i) in keys for i in range(4)), f"{from_secret} lacks a group's {pattern}"
        out.add(dest.replace(into[mount["name"]], mount["mountPath"], 1))
    return out


def test_a_replica_group_sees_its_own_credential_only() -> None:
    """Issue 41: the trainer mounts no Secret that holds another group's credential (nor the job secret)."""
    job = _find("Job", "fthsdp-replicas")
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    trainer = _container(job, "trainer")
    mounted = {volumes[m["name"]].get("secret", {}).get("secretName") for m in trainer["volumeMounts"]}
    assert not mounted & {"fthsdp-replica-credentials", "fthsdp-job-token"}, mounted
    assert _env(trainer)["FTHSDP_TOKEN_FILE"] == "/etc/fthsdp/token/credential"


def _etcd_args() -> list[str]:
    return list(_container(_find("StatefulSet", "etcd"), "etcd")["args"])


def _etcd_requires_client_certs(args: list[str]) -> None:
    """etcd serves clients and peers over TLS only and requires certificates signed by its CA from both."""
    for switch in ("--client-cert-auth", "--peer-client-cert-auth"):
        assert switch in args or f"{switch}=true" in args, f"etcd runs without {switch}"
    assert not any(a.startswith(("--auto-tls", "--peer-auto-tls")) for a in args), "self-signed auto TLS"
    for f in ("--cert-file", "--key-file", "--trusted-ca-file", "--peer-cert-file", "--peer-key-file",
              "--peer-trusted-ca-file"):
        assert _flag(args, f), f
    urls = [u for f in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls",
                        "--initial-advertise-peer-urls") for u in _flag(args, f).split(",")]
    urls += [m.split("=", 1)[1] for m in _flag(args, "--initial-cluster").split(",")]
    assert urls and all(u.startswith("https://") for u in urls), f"etcd URLs not all https: {urls}"


def test_etcd_requires_tls_and_client_certificates() -> None:
    """Nobody without a certificate from the etcd CA can rewrite the epoch or the leader key: etcd.yaml speaks
    TLS on the client and peer ports and requires client and peer certificates; the lighthouse presents one."""
    args = _etcd_args()
    _etcd_requires_client_certs(args)
    lh = _container(_find("StatefulSet", "lighthouse"), "lighthouse")["args"]
    assert all(_flag(lh, f) for f in ("--etcd-ca", "--etcd-cert", "--etcd-key"))
    # kubelet's probes carry no client certificate: they go to the health-only plain port, never 2379 or 2380.
    metrics_port = int(_flag(args, "--listen-metrics-urls").rsplit(":", 1)[1])
    etcd = _container(_find("StatefulSet", "etcd"), "etcd")
    for probe in ("readinessProbe", "livenessProbe"):
        assert etcd[probe]["httpGet"]["port"] == metrics_port, probe


@pytest.mark.parametrize("break_it", [
    lambda a: a.remove("--client-cert-auth"),
    lambda a: a.remove("--peer-client-cert-auth"),
    lambda a: a.__setitem__(next(i for i, x in enumerate(a) if x.startswith("--listen-client-urls=")),
                            "--listen-client-urls=http://0.0.0.0:2379"),
    lambda a: a.__setitem__(next(i for i, x in enumerate(a) if x.startswith("--initial-cluster=")),
                            _flag(a, "--initial-cluster").replace("https://", "http://", 1)),
], ids=["no-client-cert-auth", "no-peer-cert-auth", "plaintext-client-url", "plaintext-peer"])
def test_etcd_check_catches_a_weakened_etcd(break_it: Any) -> None:
    args = _etcd_args()
    _etcd_requires_client_certs(args)  # as shipped: passes
    break_it(args)
    with pytest.raises(AssertionError):
        _etcd_requires_client_certs(args)


def _pods() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every workload in deploy/k8s."""
    return [(d, d["spec"]["template"]) for _, d in DOCS if "template" in d.get("spec", {})]


def _listen_ports(doc: dict[str, Any], c: dict[str, Any]) -> set[int]:
    """The ports the container's process listens on, read from its own flags and FTHSDP_* settings (what the
    code binds), not from its containerPorts."""
    args = [a for a in c.get("args", []) if a.startswith("--") and "=" in a]
    ports: set[int] = set()
    for a in args:
        flag, value = a.split("=", 1)
        if flag in ("--bind", "--http") or flag.startswith("--listen-"):
            ports |= {int(u.rsplit(":", 1)[1]) for u in value.split(",")}
    env = _env(c)
    if "FTHSDP_METRICS_PORT" in env:  # one exporter per local rank
        base = int(env["FTHSDP_METRICS_PORT"])
        ports |= set(range(base, base + int(_flag(c["args"], "--nproc-per-node"))))
    return ports


def test_container_ports_are_what_the_processes_listen_on() -> None:
    """Every containerPort, Service target and probe port is one the process really listens on (its flags, as the
    code reads them), so a renamed flag or moved port shows up here."""
    for doc, template in _pods():
        for c in template["spec"]["containers"]:
            listening = _listen_ports(doc, c)
            named = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            assert set(named.values()) <= listening, f"{doc['metadata']['name']}: {named} vs {listening}"
            for probe in ("readinessProbe", "livenessProbe"):
                if probe in c:
                    port = c[probe]["httpGet"]["port"]
                    assert named.get(port, port) in listening, f"{doc['metadata']['name']} {probe}"
            labels = template["metadata"]["labels"]
            for _, svc in DOCS:
                if svc["kind"] == "Service" and svc["spec"]["selector"].items() <= labels.items():
                    for p in svc["spec"]["ports"]:
                        target = p.get("targetPort", p["port"])
                        assert named.get(target, target) in listening, f"Service {svc['metadata']['name']}: {p}"


def test_network_policy_admits_what_the_system_needs_and_no_more() -> None:
    """networkpolicy.yaml: a default deny, then etcd's client port from the lighthouse only, its peer port from
    etcd only, the lighthouse's gRPC from the replicas, and every port of a replica from the replicas (Gloo/NCCL,
    catch-up and c10d ports are ephemeral); each policy selects pods that exist."""
    policies = {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == "NetworkPolicy"}
    assert policies["default-deny-ingress"]["spec"]["podSelector"] == {}
    pod_labels = {d["metadata"]["name"]: t["metadata"]["labels"] for d, t in _pods()}

    def selected(sel: dict[str, Any]) -> set[str]:
        return {n for n, labels in pod_labels.items() if sel.get("matchLabels", {}).items() <= labels.items()}

    def admitted(target: str, port: int) -> set[str] | None:
        """Workloads admitted to ``target``'s ``port``; None: any source."""
        out: set[str] = set()
        for pol in policies.values():
            if target not in selected(pol["spec"]["podSelector"]) or not pol["spec"].get("ingress"):
                continue
            for rule in pol["spec"]["ingress"]:
                ports = rule.get("ports")
                if ports and not any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports):
                    continue
                if "from" not in rule:
                    return None
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}, "fthsdp's own rules name pods of this namespace"
                    out |= selected(peer["podSelector"])
        return out

    for name in pod_labels:
        assert any(name in selected(p["spec"]["podSelector"]) for n, p in policies.items()
                   if n != "default-deny-ingress"), f"no policy for {name}"
    assert admitted("etcd", 2379) == {"lighthouse"}
    assert admitted("etcd", 2380) == {"etcd"}
    assert admitted("etcd", 2381) == set()  # health: the kubelet only (a pod's node is always admitted)
    assert admitted("lighthouse", 29510) == {"fthsdp-replicas"}
    assert admitted("lighthouse", 29511) is None  # token and TLS
    assert admitted("lighthouse", 12345) == set()  # nothing beside gRPC and HTTPS
    for port in (29400, 40000, 61000):  # c10d, and ephemeral ports of Gloo/NCCL and the catch-up servers
        assert admitted("fthsdp-replicas", port) == {"fthsdp-replicas"}
    assert admitted("fthsdp-replicas", 9400) is None and admitted("fthsdp-replicas", 9407) is None


# --- flags, variables, scripts -------------------------------------------------------------------------------


def _lighthouse_flags() -> set[str]:
    from fthsdp.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {s for a in sub.choices["lighthouse"]._actions for s in a.option_strings}  # type: ignore[attr-defined]


def _scripts() -> list[pathlib.Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".sh", ".sbatch"))


def _lighthouse_commands() -> list[tuple[str, list[str]]]:
    """Every ``fthsdp lighthouse`` invocation in deploy/: (where, its flags)."""
    out = []
    for _, doc in DOCS:
        for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            if c.get("command", [])[-1:] == ["lighthouse"]:
                out.append((f"k8s {doc['metadata']['name']}", [a.split("=", 1)[0] for a in c.get("args", [])]))
    for path in _scripts() + sorted(DEPLOY.rglob("*.md")):
        text = re.sub(r"\\\n", " ", path.read_text())  # join continued lines
        for m in re.finditer(r"fthsdp(?:\"?\s+--log-level\s+\S+)?\s+lighthouse\b([^\n;|&]*)", text):
            out.append((path.name, re.findall(r"(?<![\w-])--[a-z][a-z-]*", m.group(1))))
    return out


def test_lighthouse_flags_exist() -> None:
    known = _lighthouse_flags()
    commands = _lighthouse_commands()
    assert len(commands) >= 3, commands  # k8s, the torchrun script, the sbatch script
    for where, flags in commands:
        unknown = set(flags) - known
        assert not unknown, f"{where}: `fthsdp lighthouse` has no flag {sorted(unknown)}"


def test_shell_scripts_parse() -> None:
    scripts = _scripts()
    assert {p.name for p in scripts} >= {"single_host.sh", "fthsdp.sbatch"}
    for path in scripts:
        r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30, check=False)
        assert r.returncode == 0, f"{path}: {r.stderr}"


def _env_table() -> dict[str, str]:
    """The variable table of deploy/torchrun/README.md: variable -> the 'read by' column."""
    rows = {}
    for line in (DEPLOY / "torchrun" / "README.md").read_text().splitlines():
        m = re.match(r"\|\s*`([A-Z][A-Z0-9_]*)`\s*\|\s*([^|]*)\|", line)
        if m:
            rows[m.group(1)] = m.group(2).strip()
    return rows


def test_env_table_matches_config() -> None:
    table = _env_table()
    config = set(re.findall(r"``(FTHSDP_[A-Z_]+)``", (ROOT / "fthsdp" / "runtime" / "config.py").read_text()))
    assert config, "fthsdp/runtime/config.py documents no FTHSDP_* variable"
    missing = config - table.keys()
    assert not missing, f"deploy/torchrun/README.md does not document {sorted(missing)}"
    for var, reader in table.items():
        if not var.startswith("FTHSDP_") or reader.startswith("pending"):
            continue
        path = ROOT / reader.strip("` ")
        assert path.is_file(), f"{var}: 'read by' {reader!r} is not a file of the repository"
        assert var in path.read_text(), f"{var} is documented as read by {reader} but that file never names it"


def test_every_variable_deploy_uses_is_documented() -> None:
    table = _env_table()
    used: dict[str, str] = {}
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file() and path.suffix in (".sh", ".sbatch", ".yaml", ".md") or path.name == "Dockerfile":
            for var in re.findall(r"\bFTHSDP_[A-Z][A-Z0-9_]*", path.read_text()):
                used.setdefault(var, str(path.relative_to(ROOT)))
    assert "FTHSDP_REPLICA_INDEX" in used
    undocumented = {v: p for v, p in used.items() if v not in table}
    assert not undocumented, f"FTHSDP_* variables used in deploy/ but not in the table: {undocumented}"


# --- deploy/torchrun/single_host.sh, run ---------------------------------------------------------------------


@pytest.mark.slow
def test_single_host_script_restarts_groups(tmp_path: pathlib.Path) -> None:
    """A real run of the script (a real lighthouse and torchrun, a stand-in trainer): torchrun restarts a failed
    worker in place, the script restarts a group whose torchrun gave up, and stops at a fatal error."""
    workdir = tmp_path / "run"
    plan = {0: [75], 1: ["fatal", "fatal"], 2: [1, 1]}  # exit status of each run, per group (then 0)
    env = {**os.environ, "DEPLOY_TEST_PLAN": ";".join(f"{i}={','.join(map(str, c))}" for i, c in plan.items() if c)}
    proc = subprocess.Popen(["bash", str(DEPLOY / "torchrun" / "single_host.sh"), "--replicas", "3", "--ranks", "1",
                             "--steps", "7", "--module", "tests.helpers.deploy_worker", "--max-restarts", "1",
                             "--group-restarts", "2", "--restart-delay", "0.2", "--workdir", str(workdir),
                             "--", "--extra", "x"],
                            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the script's trap ends the lighthouse and the groups it started
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"single_host.sh did not finish within 100 s:\n{out}")
    assert proc.returncode != 0, out  # group 1 gave up
    runs = {}
    for i in plan:
        rows = [json.loads(x) for x in (workdir / f"replica{i}.progress.jsonl").read_text().splitlines()]
        runs[i] = [x for x in rows if x["event"] == "run"]
        for x in runs[i]:
            assert x["lighthouse_reachable"] and x["num_replicas"] == "3"
            assert x["share_store_disabled"] == "1"  # torchrun restarts workers here (pytorch#135712)
            assert x["args"] == ["--steps", "7", "--model", "tiny", "--extra", "x"]
    # torchrun's restart count per run: a restart in place counts up; a new torchrun (the script's restart)
    # starts again at 0.
    assert [x["restart_count"] for x in runs[0]] == [0, 1]  # 75, restarted in place, then done
    assert [x["restart_count"] for x in runs[1]] == [0, 1]  # fatal twice: torchrun gave up, the script stopped
    assert [x["restart_count"] for x in runs[2]] == [0, 1, 0]  # torchrun gave up, the script started a new one
    assert "group 0: finished" in out and "group 2: finished" in out
    assert "group 0: exit status" not in out  # restarted by torchrun, not by the script
    assert "group 2: start (incarnation 2)" in out
    assert "group 1: fatal" in out and "group 1: start (incarnation 2)" not in out


def test_lighthouse_probes_need_no_token() -> None:
    """The lighthouse requires the job token on every HTTP path but /healthz, and a probe cannot carry a Secret:
    its HTTP probes must use /healthz, over HTTPS when TLS is on."""
    lh = _container(_find("StatefulSet", "lighthouse"), "lighthouse")
    tls = any(a.startswith("--tls-cert=") for a in lh["args"])
    for probe in ("readinessProbe", "livenessProbe"):
        get = lh[probe].get("httpGet")
        if get is not None:
            assert get["path"] == "/healthz", probe
            assert get.get("scheme", "HTTP") == ("HTTPS" if tls else "HTTP"), probe
