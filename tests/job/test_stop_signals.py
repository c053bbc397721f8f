"""The job's stop signals stay the job's while a vLLM pass is built (issue 63): Ray's
`build_processor` calls `ray.init(ignore_reinit_error=True)`, which installs Ray's SIGTERM
handler (`sys.exit(15)`) before it finds Ray started. With it, a SIGTERM during a vLLM pass
exited 15 with no `error:` line. The jobs run for real: tests/whole_job/test_signals.py,
tests/evaluation/test_acceptance_job.py."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from support import job_config
from eagle_data import errors
from eagle_data.errors import Stopped, stop_on_signals, stop_signals_kept


@pytest.mark.vllm  # imports ray.data.llm's vLLM stage (vLLM's config classes)
def test_building_a_vllm_pass_keeps_the_jobs_stop_signals(ray_local, own_signal_handlers, tiny_qwen3, tmp_path):
    from eagle_data.job.stages.engines.vllm_backend import build_vllm_processor

    stop_on_signals()
    build_vllm_processor(job_config(tmp_path / "out", tiny_qwen3, engine__backend="vllm", engine__device="cpu"))
    assert signal.getsignal(signal.SIGTERM) is errors._stop
    assert signal.getsignal(signal.SIGINT) is errors._stop


def rays_sigterm_handler(signum, frame):  # what ray.init installs (ray/_private/worker.py)
    sys.exit(signum)


def test_a_sigterm_met_by_a_handler_installed_meanwhile_is_a_stop(own_signal_handlers):
    stop_on_signals()
    with pytest.raises(Stopped) as stopped:
        with stop_signals_kept():
            signal.signal(signal.SIGTERM, rays_sigterm_handler)
            os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is errors._ignore  # a second stop signal no longer cuts the unwinding
    with stop_signals_kept():
        signal.signal(signal.SIGTERM, rays_sigterm_handler)
    assert signal.getsignal(signal.SIGTERM) is errors._ignore
    stop_on_signals()
    with stop_signals_kept():
        signal.signal(signal.SIGTERM, rays_sigterm_handler)
    assert signal.getsignal(signal.SIGTERM) is errors._stop
    with pytest.raises(SystemExit):  # an exit of its own is not a stop
        with stop_signals_kept():
            sys.exit(3)
