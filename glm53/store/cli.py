"""`glm53 store pack | verify | compare | probe`. Exit codes: 0 ok, 1 a check failed,
2 usage or environment error (130 when interrupted)."""

from __future__ import annotations

import argparse
import errno
import os
import sys

from glm53.store.errors import (
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    StoreError,
    reason,
)

# glm53.store.hashing.ENGINES, spelled out so that building the parser loads no native module
SHA256_ENGINES = ("auto", "x16", "openssl")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "store",
        help="pack, verify, compare or probe the NVMe expert store",
        description="The NVMe expert store: one file of 4 KiB-aligned expert records plus a JSON "
        "manifest with a sha256 per record (docs/store-format.md). Exit codes: 0 ok, 1 a check "
        "failed, 2 usage or environment error.",
    )
    p.set_defaults(func=lambda args: _usage(p))
    sub = p.add_subparsers(dest="store_command", metavar="ACTION")

    pk = sub.add_parser(
        "pack",
        help="write a checkpoint's routed experts into a store",
        description="Read the routed experts of a GLM-5.3-Flash EXL3 checkpoint by their "
        "safetensors offsets and write them, hashed, as O_DIRECT records into --out. The "
        "manifest is written last, so an interrupted pack never looks finished.",
    )
    pk.add_argument("--model", required=True, help="checkpoint directory (config.json, shards)")
    pk.add_argument("--out", required=True, help="store directory (created; outside --model)")
    pk.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted pack, or repair a store: re-verify the records already "
        "written and pack only the missing or bad ones",
    )
    pk.add_argument(
        "--no-mtp", action="store_true", help="leave out the MTP layer's experts (kept by default)"
    )
    pk.add_argument("--threads", type=_positive, help="source read threads (default 4-16)")
    pk.add_argument("--io-threads", type=_positive, default=8, help="O_DIRECT writer threads")
    pk.add_argument("--hash-threads", type=_positive, help="sha256 threads (default 2-8)")
    _sha256_argument(pk)
    pk.set_defaults(func=_guard(_pack))

    vf = sub.add_parser(
        "verify",
        help="re-read every record with O_DIRECT and check its sha256",
        description="Re-read every record with O_DIRECT and compare its sha256 with the "
        "manifest; prints the read rate (a first measure of the drive) and every bad record. "
        "With --model, also checks that the store was packed from that checkpoint.",
    )
    vf.add_argument("--store", required=True, help="store directory")
    vf.add_argument("--model", help="checkpoint the store will be served with")
    vf.add_argument("--threads", type=_positive, help="hash threads (default 2-8)")
    vf.add_argument("--io-threads", type=_positive, default=8, help="O_DIRECT reader threads")
    _sha256_argument(vf)
    vf.set_defaults(func=_guard(_verify))

    cp = sub.add_parser(
        "compare",
        help="byte-compare sampled records with the checkpoint",
        description="Byte-compare N random records plus the first and last record of every "
        "layer with fresh reads of the checkpoint, field by field, and check the zero padding.",
    )
    cp.add_argument("--store", required=True, help="store directory")
    cp.add_argument("--model", required=True, help="checkpoint the store was packed from")
    cp.add_argument("--sample", type=int, default=200, help="random records (default 200)")
    cp.add_argument("--seed", type=int, help="seed of the sample (default: random)")
    cp.set_defaults(func=_guard(_compare))

    pr = sub.add_parser(
        "probe",
        help="check that a file or directory supports O_DIRECT",
        description="O_DIRECT probe: a file gets one 4 KiB O_DIRECT read; a directory gets a "
        "4 KiB O_DIRECT write, read back and delete. The answer names the filesystem type.",
    )
    pr.add_argument("path", help="store file or directory")
    pr.set_defaults(func=_guard(_probe))


def _sha256_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sha256",
        choices=SHA256_ENGINES,
        default="auto",
        help="hashing engine, same digests: x16 hashes 16 records at once with AVX-512, openssl "
        "one at a time (hashlib); auto: x16 where the CPU has AVX-512 (docs/store-format.md)",
    )


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def _guard(run):
    def guarded(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except StoreError as exc:
            print(f"glm53 store {args.store_command}: error: {exc}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            print(f"glm53 store {args.store_command}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED

    return guarded


def _pack(args) -> int:
    from glm53.store.pack import pack
    from glm53.store.progress import LazyBar

    with LazyBar("verify kept") as check, LazyBar("pack") as bar:
        result = pack(
            args.model,
            args.out,
            resume=args.resume,
            include_mtp=not args.no_mtp,
            threads=args.threads,
            io_threads=args.io_threads,
            hash_threads=args.hash_threads,
            sha256=args.sha256,
            progress=bar,
            verify_progress=check,
        )
    if result.records_written == 0:
        print(f"{result.store_dir}: all {result.num_records} records verified; nothing to pack")
        return 0
    kept = f", {result.records_kept} kept" if result.records_kept else ""
    written = result.records_written * result.total_bytes / result.num_records
    print(
        f"packed {result.records_written} records{kept} ({written / 1e9:.2f} GB) into "
        f"{result.store_dir} in {result.seconds:.1f} s: {result.gbps:.2f} GB/s "
        f"(sha256: {result.sha256_engine})"
    )
    print(f"next: glm53 store verify --store {result.store_dir} --model {args.model}")
    return 0


def _verify(args) -> int:
    from glm53.store.progress import LazyBar
    from glm53.store.verify import verify

    with LazyBar("verify") as bar:
        result = verify(
            args.store,
            args.model,
            threads=args.threads,
            io_threads=args.io_threads,
            sha256=args.sha256,
            progress=bar,
        )
    print(
        f"verified {result.num_records} records of {result.store_dir}: "
        f"{result.bytes_read / 1e9:.2f} GB in {result.seconds:.1f} s, {result.gbps:.2f} GB/s "
        f"(O_DIRECT read + sha256, {result.sha256_engine})"
    )
    if result.ok:
        print("ok: every record matches its sha256")
        return 0
    if result.size_problem:
        print(f"BAD: {result.size_problem}")
    if result.bad:
        print(f"BAD: {len(result.bad)} of {result.num_records} records fail:")
        for bad in result.bad:
            print(f"  {bad.line()}")
    print(
        "fix: rewrite the bad records with "
        f"`glm53 store pack --model CHECKPOINT --out {result.store_dir} --resume`"
    )
    return EXIT_CHECK_FAILED


def _compare(args) -> int:
    from glm53.store.compare import compare
    from glm53.store.progress import LazyBar

    with LazyBar("compare", unit="records") as bar:
        result = compare(args.store, args.model, sample=args.sample, seed=args.seed, progress=bar)
    print(
        f"compared {len(result.records)} records ({result.bytes_compared / 1e6:.1f} MB) of "
        f"{result.store_dir} with {args.model}, field by field"
    )
    if result.ok:
        print("ok: every sampled record equals the checkpoint's bytes; padding is zero")
        return 0
    print(f"BAD: {len(result.mismatches)} differences:")
    for m in result.mismatches:
        print(f"  {m.line()}")
    print(
        f"fix: repack: `glm53 store pack --model {args.model} --out {result.store_dir} --resume`"
        " rewrites records whose sha256 fails; if verify passes, the store was packed wrong: "
        "pack into a new directory"
    )
    return EXIT_CHECK_FAILED


def _probe(args) -> int:
    from glm53._odirect import ODirectError, filesystem_of, probe

    fstype, mount = filesystem_of(args.path)
    try:
        probe(args.path)
    except FileNotFoundError as exc:
        raise StoreError(str(exc.strerror)) from None
    except ODirectError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            raise StoreError(reason(exc), EXIT_CHECK_FAILED) from None
        raise StoreError(reason(exc)) from None
    except OSError as exc:
        raise StoreError(f"probe of {args.path} failed: {reason(exc)}") from None
    what = "writes and reads" if os.path.isdir(args.path) else "reads"
    print(f"ok: {args.path} ({fstype} at {mount}) supports O_DIRECT {what}")
    return 0
