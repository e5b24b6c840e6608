"""The multislice executor keeps its two retry budgets apart: failures of the code use `max_retries_failure`,
preemptions (a killed host) use `max_retries_preemption`. The defaults differ by five orders of magnitude."""
import inspect

from eformer_nb.executor.ray import (
    JobFailed, JobPreempted, RayExecutor, TpuAcceleratorConfig, execute_multislice_resumable,
)
from test_executor_faults import _always_killed, _always_raises, clean, cluster  # noqa: F401 (fixtures)

SLICES2 = dict(type="v4-8", pod_count=2, cpu_count=1)
FAST = dict(timeout_s=120, schedule_timeout_s=60, retry_delay_s=0.1)


def test_default_budgets():
    for fn in (execute_multislice_resumable, RayExecutor.execute_multislice_resumable):
        params = inspect.signature(fn).parameters
        assert (params["max_retries_preemption"].default, params["max_retries_failure"].default) == (int(1e6), 10)


def test_multislice_failure_uses_the_failure_budget(clean):  # noqa: F811
    st = execute_multislice_resumable(_always_raises, TpuAcceleratorConfig(**SLICES2), max_retries_preemption=3,
                                      max_retries_failure=0, x=5, **FAST)
    assert isinstance(st, JobFailed) and [a.outcome for a in st.attempts] == ["failed"], st


def test_multislice_preemption_uses_the_preemption_budget(clean):  # noqa: F811
    st = execute_multislice_resumable(_always_killed, TpuAcceleratorConfig(**SLICES2), max_retries_preemption=1,
                                      max_retries_failure=3, **FAST)
    assert isinstance(st, JobPreempted) and [a.outcome for a in st.attempts] == ["preempted", "preempted"], st
