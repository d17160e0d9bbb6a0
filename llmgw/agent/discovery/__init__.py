"""What the node is: host, CPU, memory, disk, GPUs (NVML or nvidia-smi),
NVLink and adapter topology, multi-node NVLink state, InfiniBand/RoCE ports.

Parsers are pure functions over the tools' text (tested on captured
outputs); collectors read the machine and return the protocol's models.
"""

from .collect import (
    Discovery,
    DiscoveryOptions,
    collect_heartbeat_sample,
    collect_inventory,
    gpu_problems,
)
from .commands import CommandResult, run_command
from .disk import collect_storage, is_shared_fstype, parse_mounts
from .errors import DiscoveryError
from .fabric import apply_fabric, collect_imex, normalize_bus_id, parse_gpu_fabric
from .gpu_nvml import NVMLReader, NVMLUnavailable
from .gpu_smi import SMIError, parse_query_csv, query_gpus, query_usage
from .host import collect_host, os_family, parse_cpuinfo, parse_nvidia_driver_version, parse_os_release
from .infiniband import find_rocev2_gid, read_adapters
from .proc import LoadSampler, parse_loadavg, parse_meminfo, parse_proc_stat, read_memory
from .report import render_inventory
from .topology import Topology, TopologyError, apply_topology, parse_topology

__all__ = [
    "CommandResult",
    "Discovery",
    "DiscoveryError",
    "DiscoveryOptions",
    "LoadSampler",
    "NVMLReader",
    "NVMLUnavailable",
    "SMIError",
    "Topology",
    "TopologyError",
    "apply_fabric",
    "apply_topology",
    "collect_heartbeat_sample",
    "collect_host",
    "collect_imex",
    "collect_inventory",
    "collect_storage",
    "find_rocev2_gid",
    "gpu_problems",
    "is_shared_fstype",
    "normalize_bus_id",
    "os_family",
    "parse_cpuinfo",
    "parse_gpu_fabric",
    "parse_loadavg",
    "parse_meminfo",
    "parse_mounts",
    "parse_nvidia_driver_version",
    "parse_os_release",
    "parse_proc_stat",
    "parse_query_csv",
    "parse_topology",
    "query_gpus",
    "query_usage",
    "read_adapters",
    "read_memory",
    "render_inventory",
    "run_command",
]
