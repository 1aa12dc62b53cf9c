"""Connecting to a Ray cluster, and the checks that turn Ray's waits into clear errors within seconds.

    with connect("auto") as where: ...           # a running cluster on this machine (`ray start --head`)
    with connect("10.0.0.5:6379") as where: ...  # its GCS address;  "ray://10.0.0.5:10001": through Ray Client
    with connect("local", num_cpus=4) as where: ...  # a single-machine cluster of our own, stopped on exit

Facts this relies on (Ray 2.60, docs/dependencies.md "Ray"):
- `ray.init(address="host:port")` on an address nobody listens on retries for about a minute before failing, and a
  task asking for resources no node has waits forever (the autoscaler might add a node). So the address is probed
  with a plain TCP connect first (a few seconds), and every request is checked against the live nodes' resources.
- Token authentication is on by default: a driver on a cluster node reads the token from `~/.ray/auth_token`
  (written by `ray.init`/`ray start`); any other client sets `RAY_AUTH_TOKEN` (or `RAY_AUTH_TOKEN_PATH`) to the
  cluster's token (`ray get-auth-token` prints it). We never switch it off.
- A single-machine cluster listens on the host's own address unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which
  makes Ray use 127.0.0.1: `local` clusters are loopback-only. Ray reads it when it is first imported, and vLLM
  imports Ray: a process that opened an engine before may start on the host's address, which `connect` refuses.
- Workers get this package's folder on PYTHONPATH (runtime_env), so a source checkout runs the same code in its
  workers as in the driver; on a remote cluster the package must be installed on the nodes (or `working_dir`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

REPO = Path(__file__).resolve().parents[2]  # the folder that holds the `pipeline` package
PROBE_TIMEOUT_S = 5.0
INSTALL = "pip install -e '.[ray]' (or: pip install ray==2.60.0)"


class RayError(UserError, RuntimeError):
    """Ray is missing, unreachable, or cannot run what was asked; the message names the address/resource and fix."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayError(f"Ray is not installed in this Python ({INSTALL})") from None
    return ray


def require_ray() -> None:
    """Refuse early, without importing Ray (a `local` cluster must set its environment before the import)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise RayError(f"Ray is not installed in this Python ({INSTALL})")


def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """A TCP connect to `host:port` (or `ray://host:port`): refuse an unreachable address in seconds, before Ray
    starts its own minute-long retries."""
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise RayError(f"--address {address!r}: expected auto, local, HOST:PORT (the GCS, default port 6379) or "
                       "ray://HOST:PORT (Ray Client, default port 10001)")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise RayError(f"no Ray cluster reachable at {address} ({e.strerror or e}); start one there (`ray start "
                       "--head`), fix --address, or use --address local for a single-machine cluster") from None


def runtime_env() -> dict:
    """What every worker needs from the driver's environment: this checkout on PYTHONPATH, our log settings, a pause
    point ($GKD_PAUSE_AT, pipeline/pause.py: a test stops a task there)."""
    env = {"PYTHONPATH": f"{REPO}:${{PYTHONPATH}}"}
    for name in ("GKD_LOG_LEVEL", "VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL", "TRANSFORMERS_VERBOSITY",
                 "HF_HUB_DISABLE_PROGRESS_BARS", "HF_HOME", "HF_HUB_OFFLINE", "GKD_PAUSE_AT"):
        if name in os.environ:
            env[name] = os.environ[name]
    return {"env_vars": env}


@contextlib.contextmanager
def connect(address: str = "auto", num_cpus: float | None = None, num_gpus: float | None = None) -> Iterator[str]:
    """Connect this process to the cluster at `address` (see the module docstring) and yield where it is; a cluster
    this call started (`local`), or a connection it opened, is closed on exit. A process already connected (a
    test session, a notebook) keeps its connection."""
    if address == "local":  # loopback only (module docstring); read when Ray is first imported
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = import_ray()
    if ray.is_initialized():
        yield ray.get_runtime_context().gcs_address
        return
    kwargs: dict[str, Any] = {"runtime_env": runtime_env(), "log_to_driver": True}
    if address == "local":
        kwargs.update(address="local", include_dashboard=False,
                      num_cpus=int(num_cpus) if num_cpus is not None else None,
                      num_gpus=int(num_gpus) if num_gpus is not None else None)
    elif address != "auto":
        probe(address)
        kwargs["address"] = address
    else:
        kwargs["address"] = "auto"
    try:
        ray.init(**kwargs)
    except ConnectionError as e:
        raise RayError(f"--address {address}: {str(e).splitlines()[0]}; start a cluster (`ray start --head`), pass "
                       "its address, or use --address local") from None
    except Exception as e:  # auth failures, version mismatches: Ray's own message says which
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = " (token auth: set RAY_AUTH_TOKEN to the cluster's token, `ray get-auth-token` on its head)" \
            if "auth" in text.lower() or "token" in text.lower() else ""
        raise RayError(f"cannot connect to Ray at {address}: {text}{hint}") from None
    where = ray.get_runtime_context().gcs_address
    if address == "local" and not where.startswith("127.0.0.1:"):
        ray.shutdown()
        raise RayError(f"--address local started a cluster on {where}, not on 127.0.0.1: Ray was imported in this "
                       "process (vLLM imports it) before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 could be set; set "
                       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment, or start a cluster with `ray start "
                       "--head` and pass its address")
    try:
        yield where
    finally:
        ray.shutdown()


def enter_cwd(cwd: str) -> None:
    """In a worker: the driver's working directory, where it exists on this node (a shared filesystem), so relative
    paths in stage arguments and configs mean what they mean to the driver."""
    if os.path.isdir(cwd):
        os.chdir(cwd)


def check_resources(need: dict[str, float], what: str, count: int = 1) -> None:
    """Refuse, instead of waiting forever, a request no live node can hold: `count` units of `need` (e.g. CPU, GPU)
    each. One unit must fit on one node; all `count` together must fit in the whole cluster (actors that live at
    once)."""
    ray = import_ray()
    need = {k: v for k, v in need.items() if v}
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = [n for n in nodes if all(n["Resources"].get(k, 0.0) >= v for k, v in need.items())]
    asked = ", ".join(f"{k}={v:g}" for k, v in need.items())
    if not fits:
        have = "; ".join(", ".join(f"{k}={n['Resources'].get(k, 0.0):g}" for k in need) + f" on {n['NodeManagerAddress']}"
                         for n in nodes) or "no live node"
        raise RayError(f"{what} asks for {asked} but no node of the cluster has that ({have}); lower the request, "
                       "or add a node that has it")
    total = {k: sum(n["Resources"].get(k, 0.0) for n in nodes) for k in need}
    short = [k for k, v in need.items() if v * count > total[k]]
    if short:
        raise RayError(f"{what}: {count} x {asked} must run at once but the cluster has only "
                       + ", ".join(f"{k}={total[k]:g}" for k in short) + "; lower the request or add nodes")
