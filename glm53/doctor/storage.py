"""Storage probe: block devices (`lsblk -J`), NVMe controllers and links (sysfs), md RAID
(/proc/mdstat), mounted filesystems (/proc/mounts) with their free space (statvfs)."""

from __future__ import annotations

import json
import re

from glm53.doctor.host import BlockDevice, MdArray, Mount, NvmeController, Storage
from glm53.doctor.source import Source, Unavailable

LSBLK_COLUMNS = "NAME,PATH,MODEL,SIZE,TYPE,FSTYPE,MOUNTPOINTS,ROTA,TRAN"
LSBLK_COLUMNS_OLD = "NAME,MODEL,SIZE,TYPE,FSTYPE,MOUNTPOINT,ROTA,TRAN"  # util-linux < 2.37

# filesystems whose free space the doctor reports (tmpfs and friends are RAM, not storage)
DISK_FILESYSTEMS = {
    "xfs", "ext4", "ext3", "ext2", "btrfs", "zfs", "f2fs", "bcachefs", "vfat", "exfat",
    "ntfs", "ntfs3", "fuseblk", "nfs", "nfs4", "cifs", "smb3", "overlay", "9p", "virtiofs",
}  # fmt: skip


def _bool(value) -> bool:
    return value in (True, 1, "1", "true")


def _mountpoints(node: dict) -> list[str]:
    if "mountpoints" in node:
        return [m for m in node["mountpoints"] or [] if m]
    return [node["mountpoint"]] if node.get("mountpoint") else []


def parse_lsblk(text: str) -> list[BlockDevice]:
    """`lsblk -J -b -o LSBLK_COLUMNS` (or the pre-2.37 columns). A device that sits on several
    disks (an md array over four drives) appears once, with all of them in `disks`."""
    tree = json.loads(text)["blockdevices"]
    merged: dict[str, dict] = {}
    order: list[str] = []

    def walk(node: dict, root: str) -> None:
        name = node["name"]
        entry = merged.get(name)
        if entry is None:
            order.append(name)
            entry = merged[name] = {"node": node, "disks": []}
        if root not in entry["disks"]:
            entry["disks"].append(root)
        for child in node.get("children") or []:
            walk(child, root)

    for disk in tree:
        walk(disk, disk["name"])
    devices = []
    for name in order:
        node, disks = merged[name]["node"], merged[name]["disks"]
        model = (node.get("model") or "").strip() or None
        devices.append(
            BlockDevice(
                name=name,
                path=node.get("path") or f"/dev/{name}",
                model=model,
                size_bytes=int(node.get("size") or 0),
                type=node.get("type") or "?",
                fstype=node.get("fstype") or None,
                mountpoints=_mountpoints(node),
                rotational=_bool(node.get("rota")),
                transport=node.get("tran") or None,
                disks=disks,
                has_children=bool(node.get("children")),
            )
        )
    return devices


_MD_HEAD = re.compile(
    r"^(md\S*)\s*:\s*(\S+)\s+(?:\((?:auto-)?read-only\)\s+)?(raid\d+|linear)\s+(.*)$"
)


def parse_mdstat(text: str) -> list[MdArray]:
    arrays = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _MD_HEAD.match(line.strip())
        if not m:
            continue
        members = [re.sub(r"\[\d+\].*$", "", dev) for dev in m.group(4).split()]
        detail = lines[i + 1] if i + 1 < len(lines) else ""
        chunk = re.search(r"(\d+)k chunk", detail)
        arrays.append(
            MdArray(
                name=m.group(1),
                state=m.group(2),
                level=m.group(3),
                members=members,
                chunk_kib=int(chunk.group(1)) if chunk else None,
            )
        )
    return arrays


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(text: str) -> list[tuple[str, str, str, str]]:
    """/proc/mounts -> (source, target, fstype, options)."""
    rows = []
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 4:
            rows.append((_unescape(f[0]), _unescape(f[1]), f[2], f[3]))
    return rows


def _nvme_controllers(source: Source, devices: list[BlockDevice]) -> list[NvmeController]:
    try:
        names = [n for n in source.listdir("/sys/class/nvme") if re.fullmatch(r"nvme\d+", n)]
    except Unavailable:
        return []
    controllers = []
    for name in names:
        base = f"/sys/class/nvme/{name}"

        def attr(rel: str, base: str = base) -> str | None:
            try:
                return source.read(f"{base}/{rel}").strip() or None
            except Unavailable:
                return None

        width_cur, width_max = attr("device/current_link_width"), attr("device/max_link_width")
        controllers.append(
            NvmeController(
                name=name,
                model=attr("model") or "?",
                link_speed_current=attr("device/current_link_speed"),
                link_width_current=int(width_cur) if width_cur and width_cur.isdigit() else None,
                link_speed_max=attr("device/max_link_speed"),
                link_width_max=int(width_max) if width_max and width_max.isdigit() else None,
                namespaces=[
                    d.name
                    for d in devices
                    if d.type == "disk" and re.fullmatch(rf"{name}n\d+", d.name)
                ],
            )
        )
    return controllers


def probe_storage(source: Source) -> Storage:
    try:
        text = source.run("lsblk", ["lsblk", "-J", "-b", "-o", LSBLK_COLUMNS])
    except Unavailable as e:
        if "not found" in str(e):
            raise
        text = source.run("lsblk", ["lsblk", "-J", "-b", "-o", LSBLK_COLUMNS_OLD])
    devices = parse_lsblk(text)
    try:
        md = parse_mdstat(source.read("/proc/mdstat"))
    except Unavailable:
        md = []  # no md driver loaded: no arrays
    mounts = []
    for src, target, fstype, options in parse_mounts(source.read("/proc/mounts")):
        total = free = None
        if fstype in DISK_FILESYSTEMS:
            try:
                total, free = source.statvfs(target)
            except (Unavailable, OSError):
                pass  # reported as unknown free space
        mounts.append(Mount(src, target, fstype, options, total, free))
    return Storage(devices=devices, nvme=_nvme_controllers(source, devices), md=md, mounts=mounts)
