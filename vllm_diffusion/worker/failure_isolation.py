"""The requests whose host-side work fails in a step: ``StepFailures`` finishes each alone
with its first failure as ``stop_reason`` (``step.failures.Failure``) and forgets its
diffusion state, while the others continue.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from vllm.logger import init_logger

from vllm_diffusion.step.failures import Failure, RequestFailure
from vllm_diffusion.worker.outputs import DiffusionStats

logger = init_logger(__name__)


class StepFailures:
    def __init__(self, stats: DiffusionStats, forget: Callable[[str], None]) -> None:
        self.stats = stats
        self.forget = forget  # drops a request's diffusion state
        self.reasons: dict[str, str] = {}  # req_id -> its stop_reason

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.reasons

    def fail(self, req_id: str, doing: str, err: Exception) -> None:
        """Finish ``req_id`` with an error (its first failure this step counts)."""
        if req_id in self.reasons:
            return
        failure = Failure.of(err, doing)
        if isinstance(err, RequestFailure):  # the request's own doing: no traceback
            logger.warning("vllm-diffusion: request %s ended with an error: %s", req_id,
                           failure.message)
        else:
            logger.exception("vllm-diffusion: request %s failed while %s; finishing it "
                             "with an error (other requests continue)", req_id, doing,
                             exc_info=err)
        self.forget(req_id)
        self.stats.count_failure(err)
        self.reasons[req_id] = failure.as_stop_reason()

    def fail_each(self, req_ids: list[str], errors: dict[int, tuple[str, Exception]]
                  ) -> None:
        """Fail the requests of ``errors`` (index -> (doing, exception)), in index order."""
        for i, (doing, err) in sorted(errors.items()):
            self.fail(req_ids[i], doing, err)

    @contextlib.contextmanager
    def isolated(self, req_id: str, doing: str) -> Iterator[None]:
        """Run the block's work for one request; an exception fails only that request."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 - isolated to this request
            self.fail(req_id, doing, err)
