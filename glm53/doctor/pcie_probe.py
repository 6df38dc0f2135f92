"""`python pcie_probe.py GPU_INDEX`: pinned host -> device copy rate on one GPU, best of five
256 MiB copies timed with CUDA events, printed as {"pcie_h2d_gbps": x}. Run by path in a child
process (a CUDA initialisation that hangs cannot hang the doctor); imports nothing from glm53."""

import json
import sys


def pcie_h2d_gbps(gpu_index: int, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    import torch

    dev = torch.device("cuda", gpu_index)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    target.copy_(host, non_blocking=True)  # warm-up: context, allocator, link out of idle
    torch.cuda.synchronize(dev)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return nbytes / best / 1e9


def main(argv: list) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python pcie_probe.py GPU_INDEX", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("torch is not installed", file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print("torch sees no CUDA device (a CPU build of torch, or no driver)", file=sys.stderr)
        return 3
    print(json.dumps({"pcie_h2d_gbps": round(pcie_h2d_gbps(int(argv[0])), 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
