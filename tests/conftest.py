import os

# The kernel tests run the Triton kernels on CPU tensors through Triton's interpreter where no
# GPU is present; the variable must be set before triton is first imported.
try:
    import torch as _torch
    _HAS_CUDA = _torch.cuda.is_available()
except ImportError:
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")

# Hypothesis profiles.  The default profile is Hypothesis's own (each test sets what it needs).
# ``nightly`` (docs/CHECKS.md): the lockstep machine of tests/conformance/explore/test_nightly.py with the
# CrossHair backend (needs the hypothesis-crosshair package) and many more steps; run it with
#   .venv/bin/python -m pytest tests/conformance/explore/test_nightly.py --hypothesis-profile=nightly
# (or HYPOTHESIS_PROFILE=nightly in the environment).
try:
    from hypothesis import HealthCheck as _HealthCheck
    from hypothesis import settings as _settings
except ImportError:  # pragma: no cover - Hypothesis is a dev dependency
    pass
else:
    from hypothesis.errors import InvalidArgument as _InvalidArgument
    try:
        _settings.register_profile(
            "nightly", backend="crosshair", max_examples=2000, stateful_step_count=200,
            deadline=None, database=None, print_blob=True,
            suppress_health_check=list(_HealthCheck))
    except _InvalidArgument:  # newer Hypothesis checks the backend: no hypothesis-crosshair here
        pass
    if os.environ.get("HYPOTHESIS_PROFILE"):
        _settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
