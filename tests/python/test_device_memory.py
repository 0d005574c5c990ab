"""The device's memory as `mx.device_info(mx.gpu)` reports it per backend (#35).

The dicts below have the keys mlx 0.32's backends fill in (mlx/backend/cuda/device_info.cpp:
`total_memory`, `free_memory`, no `memory_size`; mlx/backend/metal/device_info.cpp:
`memory_size`, `max_recommended_working_set_size`). Reading `memory_size` on CUDA found
nothing and budgeted the KV cache from the host's RAM instead of the card's memory.
"""

from __future__ import annotations

from compat_serve.models.device_memory import (
    cgroup_limit_bytes,
    device_memory,
    gpu_memory_from_info,
    physical_memory_bytes,
)

H100 = {
    "device_name": "NVIDIA H100 80GB HBM3",
    "architecture": "sm_90",
    "uuid": "GPU-00000000-0000-0000-0000-000000000000",
    "pci_bus_id": "0000:00:05.0",
    "compute_capability_major": 9,
    "compute_capability_minor": 0,
    "free_memory": 84_000_000_000,
    "total_memory": 85_520_809_984,
}
M3_MAX = {
    "device_name": "Apple M3 Max",
    "architecture": "applegpu_g15s",
    "memory_size": 128 * 2**30,
    "max_recommended_working_set_size": 96 * 2**30,
    "max_buffer_length": 64 * 2**30,
    "resource_limit": 499_000,
}


def test_cuda_budget_is_the_cards_total_memory_not_the_hosts_ram() -> None:
    assert gpu_memory_from_info(H100) == (85_520_809_984, "CUDA device memory")


def test_metal_budget_is_the_recommended_working_set() -> None:
    assert gpu_memory_from_info(M3_MAX) == (96 * 2**30, "Metal recommended working set")


def test_a_dict_without_memory_keys_gives_nothing() -> None:
    assert gpu_memory_from_info({"architecture": "x86_64", "device_name": "AMD EPYC"}) is None
    assert gpu_memory_from_info({"total_memory": 0}) is None


def test_on_the_cpu_backend_the_budget_is_ram_or_the_cgroup_limit() -> None:
    size, source = device_memory()
    limit = cgroup_limit_bytes()
    ram = physical_memory_bytes()
    if limit is not None and limit < ram:
        assert (size, source) == (limit, "cgroup memory limit")
    else:
        assert (size, source) == (ram, "physical RAM")
