"""``afd plan``: which A:F, how many micro-batch stages, what batch — calibrated here, checked against the system.

* :mod:`~afd_sdk.plan.profile` — what calibration measured (:class:`Profile`, JSON on disk);
* :mod:`~afd_sdk.plan.model` — the step-time model of the runtime's pipeline (:func:`predict`, :func:`plan`);
* :mod:`~afd_sdk.plan.calibrate` — measure a profile on this machine;
* :mod:`~afd_sdk.plan.validate` — run the real sweep and compare with the model;
* :mod:`~afd_sdk.plan.hardware` — plan for hardware this machine lacks, from a spec file;
* :mod:`~afd_sdk.plan.published` — published figures, reproduced.
"""

from afd_sdk.plan.model import Deployment, Prediction, plan, predict
from afd_sdk.plan.profile import Curve, Profile

__all__ = ["Curve", "Deployment", "Prediction", "Profile", "plan", "predict"]
