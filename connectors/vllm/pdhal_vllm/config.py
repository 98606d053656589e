"""The connector's configuration: kv_connector_extra_config's keys and their defaults,
checked, and an instance's kv-transfer-config built from them (`kv_transfer_config`: the
tests, the benchmark and `testing.instance` build it here, and a deployment script may).
Imports no vLLM."""

from __future__ import annotations

from pdhal_vllm.wire import KEEPALIVE_S, ConnectorError, checked_address, checked_seconds

#: The keys of kv_connector_extra_config, and their defaults (docs/engines/vllm.md).
EXTRA_CONFIG = {
    "messager": None,  # prefill: its messager's HOST:PORT; decode: the one to claim at
    "transport": "shm",  # decode: any installed transport
    "transport_options": {},  # decode: the transport's options (Transport.configure)
    "load_mode": "async",
    "load_timeout_s": 60.0,
    "keepalive_s": KEEPALIVE_S,
    "idle_wait_s": 0.01,  # decode: an idle step's longest wait for a load to end
    "auth_key": None,
    "trace": None,
}
ROLES = ("kv_producer", "kv_consumer")
#: What a decode `vllm serve` of one worker takes for an engine that sleeps while its
#: requests wait for their KV (idle_spin_advice): its worker in the engine core's process,
#: which vLLM's CPU build allows only with V1 multiprocessing off (the API server and the
#: engine core stay processes of their own).
SLEEPING_DECODE_ARGS = ("--distributed-executor-backend", "uni")
SLEEPING_DECODE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
FAILURE_POLICIES = ("fail", "recompute")


def extra_config(given: dict | None) -> dict:
    """kv_connector_extra_config `given`, its defaults filled in and checked."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(EXTRA_CONFIG))
    if unknown:
        raise ConnectorError(
            f"kv_connector_extra_config has no key {', '.join(map(repr, unknown))}: it takes "
            f"{', '.join(EXTRA_CONFIG)}"
            + (
                " (a transport's settings go in transport_options, e.g. {'host': ...})"
                if any(key.startswith(("mooncake_", "nixl_")) for key in unknown)
                else ""
            )
        )
    extra = {**EXTRA_CONFIG, **given}
    if extra["load_mode"] not in ("async", "sync"):
        raise ConnectorError(f"load_mode must be 'async' or 'sync', got {extra['load_mode']!r}")
    options = extra["transport_options"]
    if not isinstance(options, dict) or not all(isinstance(key, str) for key in options):
        raise ConnectorError(
            f"transport_options must be a JSON object of the transport's options, got {options!r}"
        )
    if extra["messager"] is not None:
        checked_address(extra["messager"], "messager")
    for key in ("transport", "auth_key", "trace"):
        value = extra[key]
        if (value is not None or key == "transport") and (not isinstance(value, str) or not value):
            raise ConnectorError(f"{key} must be a non-empty string, got {value!r}")
    for key in ("load_timeout_s", "keepalive_s"):
        checked_seconds(extra[key], key)
    wait = extra["idle_wait_s"]
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 1:
        raise ConnectorError(f"idle_wait_s must be seconds in [0, 1] (0: never wait), got {wait!r}")
    return extra


def idle_spin_advice(executor: object, world_size: int) -> str | None:
    """What a decode instance run by `executor` (vLLM's distributed_executor_backend, as
    resolved) with `world_size` workers should run instead, for an engine that sleeps while
    its requests wait for their KV; None where it sleeps already. vLLM steps its engine while
    any request waits, and an idle step waits in the worker (idle_wait_s): with a single
    worker in a process of its own ("mp"), the engine core spins on the shared-memory queue
    for its answer (bench_decode_idle). With several workers that is vLLM's to change."""
    if executor != "mp" or world_size != 1:
        return None
    [(variable, value)] = SLEEPING_DECODE_ENV.items()
    return (
        "this decode instance runs its one worker in a process of its own (the 'mp' "
        "executor), so while its requests wait for their KV, vLLM's queue between the engine "
        f"core and that worker spins about a core; run it with {' '.join(SLEEPING_DECODE_ARGS)}"
        f" (on vLLM's CPU build also {variable}={value}) and its engine waits asleep "
        "(docs/engines/vllm.md)"
    )


def kv_transfer_config(kv_role: str, failure_policy: str = "fail", **extra) -> dict:
    """The kv-transfer-config of an instance with the pdhal connector (a dict: vLLM's
    `kv_transfer_config=`, or json.dumps it for `--kv-transfer-config`). `kv_role`:
    "kv_producer" (prefill) or "kv_consumer" (decode); `failure_policy`: vLLM's
    kv_load_failure_policy for a load that failed; `extra`: kv_connector_extra_config
    (checked here, not in the server it starts)."""
    if kv_role not in ROLES:
        raise ConnectorError(f"kv_role must be one of {', '.join(ROLES)}, got {kv_role!r}")
    if failure_policy not in FAILURE_POLICIES:
        raise ConnectorError(
            f"failure_policy must be one of {', '.join(FAILURE_POLICIES)}, got {failure_policy!r}"
        )
    extra_config(extra)
    return {
        "kv_connector": "PdhalConnector",
        "kv_connector_module_path": "pdhal_vllm.connector",
        "kv_role": kv_role,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": extra,
    }
