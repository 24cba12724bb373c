"""Cluster config: what is refused with a line naming it, and what reaches the instances."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.config import ConfigError, config_from_dict, load_config

INSTANCES = [{"id": "prefill-0", "role": "prefill", "dc": "A"}, {"id": "md-0", "role": "md", "dc": "B"}]


def cfg(**extra):
    return config_from_dict({"instances": [dict(i) for i in INSTANCES], **extra})


@pytest.mark.parametrize(
    "raw, names",
    [
        ({"instances": [{**INSTANCES[0], "dtype": "float64"}, INSTANCES[1]]}, "dtype"),
        ({"instances": [{**INSTANCES[0], "device": "gpu"}, INSTANCES[1]]}, "device 'gpu'"),
        ({"instances": INSTANCES, "device": "tpu"}, "device 'tpu'"),
        ({"instances": INSTANCES, "scheduler": {"kv_wire": "int4"}}, "kv_wire"),
        ({"instances": INSTANCES, "first_token": "gateway"}, "first_token"),
        ({"instances": [INSTANCES[0]]}, "md instance"),
        ({"instances": INSTANCES, "gateway": {"pdd_object": "some"}}, "pdd_object"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(raw, names):
    with pytest.raises(ConfigError, match=names):
        config_from_dict({**raw, "instances": [dict(i) for i in raw["instances"]]})


def test_devices_and_the_cluster_wide_override():
    c = cfg(instances=[{**INSTANCES[0], "device": "cuda:1"}, INSTANCES[1]])
    assert [i.device for i in c.instances] == ["cuda:1", "cpu"] and c.device == ""
    assert cfg(device="cuda").device == "cuda"  # `pdd up --device cuda`: every instance


def test_the_demo_fleet_is_heterogeneous():
    demo = load_config(None)
    assert {i.role: i.dtype for i in demo.instances} == {"prefill": "float32", "rld": "bfloat16", "md": "bfloat16"}
    s = demo.scheduler
    assert (s.kv_wire, s.relay_finishes, s.line_backlog) == ("native", False, False)


@pytest.mark.model
def test_an_instance_is_built_on_its_device():
    """On this machine's device the engine's model and pool land there; asking for CUDA where
    there is none is a clear error, not a silent CPU run."""
    from shared.runtime.build import build_engine

    demo = load_config(None)
    inst = dataclasses.replace(demo.instance("md-0"), kv_tokens=256)
    engine = build_engine(demo, inst)
    assert engine.pool.device.type == "cpu" and engine.pool.dtype == torch.bfloat16
    if torch.cuda.is_available():
        assert build_engine(dataclasses.replace(demo, device="cuda"), inst).pool.device.type == "cuda"
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            build_engine(dataclasses.replace(demo, device="cuda"), inst)


@pytest.mark.model
def test_an_engine_chooses_its_kernels_at_its_own_thread_count(monkeypatch):
    """Without batch invariance the runner times its kernels while it is built (the packed
    weights' kernel, then plain F.linear for small steps): at the thread count the engine thread
    will run (the instance's `threads`), and the caller's count is left as it was. The default
    (batch-invariant) engine times nothing: skinny.c runs every step."""
    from shared.runtime import fused
    from shared.runtime.build import build_engine

    seen: list[int] = []

    def counted(choose):
        def run(arg):
            seen.append(torch.get_num_threads())
            return choose(arg)

        return run

    for name in ("choose_packed_kernel", "choose_small_step_kernel"):
        monkeypatch.setattr(fused, name, counted(getattr(fused, name)))
    demo = load_config(None)
    inst = dataclasses.replace(demo.instance("prefill-0"), kv_tokens=256, dtype="float32", threads=1)
    before = torch.get_num_threads()
    assert before != 1  # tests/conftest.py: 2
    assert build_engine(demo, inst).runner.invariant and seen == []
    assert not build_engine(demo, dataclasses.replace(inst, batch_invariant=False)).runner.invariant
    assert seen == [1, 1] and torch.get_num_threads() == before


def test_auto_threads_share_a_hosts_cores():
    """`threads: auto`: the decoders of a host split its cores (each steps all the time), the
    prefill instances split all of them (prefill runs in bursts while the decoders' threads
    sleep); explicit counts are kept and leave the rest; other hosts and CUDA instances are apart."""
    shipped = load_config(None)
    assert [i.threads for i in shipped.instances] == ["auto"] * 3  # configs/single-host.yaml
    assert [shipped.threads_of(i, cores=2) for i in shipped.instances] == [2, 1, 1]
    assert [shipped.threads_of(i, cores=16) for i in shipped.instances] == [16, 8, 8]
    assert [shipped.threads_of(i, cores=1) for i in shipped.instances] == [1, 1, 1]  # never 0

    def fleet(*instances, **extra):
        c = config_from_dict(
            {
                "instances": [
                    {"id": f"{r}-{n}", "role": r, "threads": "auto", **kw} for n, (r, kw) in enumerate(instances)
                ],
                **extra,
            }
        )
        return [c.threads_of(i, cores=8) for i in c.instances]

    assert fleet(("prefill", {}), ("prefill", {}), ("md", {}), ("md", {}), ("rld", {})) == [4, 4, 2, 2, 2]
    assert fleet(("prefill", {}), ("md", {"threads": 6}), ("md", {})) == [8, 6, 2]
    assert fleet(("prefill", {"threads": 3}), ("prefill", {}), ("md", {})) == [3, 5, 8]
    assert fleet(("prefill", {}), ("md", {"host": "10.0.0.2"}), ("md", {})) == [8, 8, 8]
    assert fleet(("prefill", {}), ("md", {"device": "cuda"}), ("md", {})) == [8, 1, 8]
    assert fleet(("prefill", {}), ("md", {}), device="cuda") == [1, 1]


@pytest.mark.parametrize("bad", [0, -2, "four", 1.5, None])
def test_threads_is_a_count_or_auto(bad):
    with pytest.raises(ConfigError, match="threads must be an integer >= 1 or 'auto'"):
        cfg(instances=[{**INSTANCES[0], "threads": bad}, INSTANCES[1]])


def test_a_prefill_steps_over_whole_prompts_unless_it_streams_its_kv():
    """`max_step_tokens: auto`: a prefill that pushes its KV when the prompt is done steps over
    2,048 tokens (it serves nothing else; each step reads every weight again), one that streams
    its KV chunk by chunk over 512, as the decoders do (their running decodes wait for an extend);
    a count is kept, and reaches the engine."""
    assert [cfg().step_tokens_of(i) for i in cfg().instances] == [2048, 512]
    assert [cfg(stream_kv=True).step_tokens_of(i) for i in cfg().instances] == [512, 512]
    mine = cfg(instances=[{**INSTANCES[0], "max_step_tokens": 300}, INSTANCES[1]])
    assert mine.step_tokens_of(mine.instances[0]) == 300
    with pytest.raises(ConfigError, match="max_step_tokens must be an integer >= 1 or 'auto'"):
        cfg(instances=[{**INSTANCES[0], "max_step_tokens": 0}, INSTANCES[1]])


def test_stream_layers_max_tokens_is_a_count_and_zero_turns_it_off():
    assert cfg().stream_layers_max_tokens == 256 and cfg(stream_layers_max_tokens=0).stream_layers_max_tokens == 0
    with pytest.raises(ConfigError, match="stream_layers_max_tokens must be >= 0"):
        cfg(stream_layers_max_tokens=-1)


def test_the_run_config_holds_each_instances_resolved_threads(tmp_path):
    """`pdd up` writes the config its services read: every `auto` is this host's count there."""
    import os

    from pdd.topology import resolve

    cores = len(os.sched_getaffinity(0))
    run = resolve(load_config(None), tmp_path)
    assert {i.id: i.threads for i in run.instances} == {
        "prefill-0": cores,
        "rld-0": max(1, cores // 2),
        "md-0": max(1, cores // 2),
    }
    assert {i.id: i.max_step_tokens for i in run.instances} == {"prefill-0": 2048, "rld-0": 512, "md-0": 512}


def test_pdd_serve_gives_sleeping_openmp_threads_where_instances_share_a_host(monkeypatch, tmp_path):
    """`pdd serve md` from the shipped config (three instances on one host) becomes the service
    with OMP_WAIT_POLICY=PASSIVE and no spin first (no launcher, no core board to keep the
    instances off each other's cores); on a host of its own it is left alone."""
    import os

    from pdd import launcher

    for name, value in {"PDD_NATS_URL": "nats://127.0.0.1:1", "PDD_SECRETS_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    became = []
    wait = lambda: (os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))  # noqa: E731
    monkeypatch.setattr(os, "execv", lambda path, argv: became.append((argv, wait())))
    monkeypatch.setattr(os, "chdir", lambda path: None)
    launcher.serve_one("md", None, "md-0")
    assert became and became[0][0][-2:] == ["--instance", "md-0"] and became[0][1] == ("PASSIVE", None)

    from pdd.launcher import shares_host

    shipped = load_config(None)
    assert shares_host(shipped, shipped.instance("md-0"))
    apart = config_from_dict({"instances": [{**INSTANCES[0], "host": "a"}, {**INSTANCES[1], "host": "b"}]})
    assert not shares_host(apart, apart.instance("md-0"))
