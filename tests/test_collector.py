"""The garbage collector held to step boundaries (``pyparallel.collector``): ``held`` and ``StepCollector``
restore the process's collector, a step collector frees cyclic garbage at its steps and only there, and
no collection starts inside a pipeline step on any stage (which then trains as without it)."""

import gc
import weakref

import pytest
from dist import run
from test_pipeline import compare, gpt_data, reference, tiny_gpt, train_pipe

import pyparallel
from pyparallel import collector
from pyparallel.pipeline_parallel import PipelineParallel


class _Cycle:
    """An object that only the cyclic collector can free (it refers to itself)."""

    def __init__(self):
        self.me = self


def _cycle():
    c = _Cycle()
    ref = weakref.ref(c)
    del c
    return ref


@pytest.fixture
def restore_gc():
    was = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


def test_held_restores_the_collector_and_nests(restore_gc):
    gc.enable()
    with collector.held():
        assert not gc.isenabled()
        with collector.held():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block found it off and leaves it off
    assert gc.isenabled()
    gc.disable()
    with collector.held():
        pass
    assert not gc.isenabled()  # a process that had it off keeps it off
    gc.enable()
    with pytest.raises(KeyError), collector.held():
        raise KeyError("inside")
    assert gc.isenabled()


def test_step_collector_frees_cycles_at_its_steps_only(restore_gc):
    gc.enable()
    before = _cycle()
    with collector.StepCollector(every=3) as steps:
        assert before() is None  # setup's garbage is collected, not frozen
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        ref = _cycle()
        for _ in range(2000):  # far past the default threshold (700): the automatic collector stays off
            _Cycle()
        steps.step()
        steps.step()
        assert ref() is not None
        steps.step()  # the third: collects
        assert ref() is None
    assert gc.isenabled() and gc.get_freeze_count() == 0


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_step_collector_refuses_a_bad_interval(every):
    with pytest.raises(ValueError, match="N >= 1"):
        collector.StepCollector(every)


def gc_body(schedule):
    """Train with the collector at its most eager (threshold 1: a collection after every new container
    object), against one process; record any collection that starts inside the schedule."""
    mesh = pyparallel.init(pp=2)
    cfg, make = tiny_gpt(3)
    data = gpt_data(cfg)
    ref = reference(make, data)
    model = make()
    pipe = PipelineParallel(model, mesh, schedule=schedule, num_microbatches=4)
    inside, starts = [False], {"in": 0, "out": 0}
    run_schedule = pipe._run

    def traced(*args):
        inside[0] = True
        try:
            return run_schedule(*args)
        finally:
            inside[0] = False

    def seen(phase, _info):
        if phase == "start":
            starts["in" if inside[0] else "out"] += 1

    pipe._run = traced
    threshold = gc.get_threshold()
    gc.callbacks.append(seen)
    gc.set_threshold(1)
    try:
        losses = train_pipe(pipe, data)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(seen)
    compare(model, pipe, losses, ref)
    return starts, gc.isenabled()


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_no_collection_starts_inside_a_pipeline_step(schedule):
    results = run(gc_body, 2, schedule)
    for starts, enabled in results:
        assert starts["in"] == 0, starts
        assert starts["out"] > 0  # the probe sees collections: they ran between the steps
        assert enabled


def parallel_step_body():
    """``ParallelModel.step`` (ZeRO-3 over dp = 2): the collector is off in the weight gather, the pipeline
    and the optimizer's step (each has collectives), and back on after the step."""
    mesh = pyparallel.init(dp=2)
    cfg, make = tiny_gpt(2)
    pm = pyparallel.parallelize(make(), mesh, zero_stage=3, lr=1e-2)
    seen = []

    def spy(name, fn):
        def wrapped(*a, **k):
            seen.append((name, gc.isenabled()))
            return fn(*a, **k)
        return wrapped

    pm.engine.begin_step = spy("gather", pm.engine.begin_step)
    pm.optimizer.step = spy("optimizer", pm.optimizer.step)
    idx, tgt = gpt_data(cfg)[0]
    pm.step(*pyparallel.shard_batch((idx, tgt), mesh))
    return seen, gc.isenabled()


def test_parallel_model_step_holds_the_collector_throughout():
    for seen, enabled in run(parallel_step_body, 2):
        assert seen == [("gather", False), ("optimizer", False)]
        assert enabled
