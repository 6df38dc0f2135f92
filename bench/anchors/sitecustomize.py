"""Workaround for stock exllamav3 1.6.5's CPU MoE offload on the H200 test host, used only by
bench/exl3_offload.py to measure the anchor (never by glm53 itself).

`exllamav3_ext.exl3_moe_cpu_core_order()` segfaults there (facts: exllamav3-glm5next-checkpoint.md
§7 item 8). With GLM53_EXL3_CORE_ORDER_FIX=1 this module, which Python imports at start-up from
PYTHONPATH in the parent and in the spawned worker alike, replaces it with a sysfs reading of the
same answer: one logical CPU per physical core first, then their SMT siblings, and the number of
physical cores. EXL3_MOE_CPU_PIN=0 must be set as well."""

import glob
import os


def _core_order():
    cores = {}
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/core_id"):
        cpu = int(path.split("/")[5][3:])
        base = os.path.dirname(path)
        with open(path) as f:
            core = int(f.read())
        with open(os.path.join(base, "physical_package_id")) as f:
            pkg = int(f.read())
        cores.setdefault((pkg, core), []).append(cpu)
    groups = [sorted(v) for _, v in sorted(cores.items())]
    order = [g[0] for g in groups] + [c for g in groups for c in g[1:]]
    return order, len(groups)


if os.environ.get("GLM53_EXL3_CORE_ORDER_FIX") == "1":
    import torch  # noqa: F401, I001  (first: the extension links libtorch)
    import exllamav3_ext  # noqa: I001

    exllamav3_ext.exl3_moe_cpu_core_order = _core_order
