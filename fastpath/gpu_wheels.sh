#!/usr/bin/env bash
# The Python packages the test suite needs that a lent GPU machine's image lacks (it has torch, triton,
# transformers, pytest, matplotlib, tiktoken, but not the notebook packages, ruff, gguf or pytest-xdist, which
# runs the suite in several processes), downloaded here as wheels for its Python (3.12, x86-64 Linux) into
# the ignored folder .gpu_cache/wheels, at the versions this machine has installed (the ones the suite is
# tested with; requirements.txt's, the README's set-up installs them). gpu_check.sh's suite stage installs
# them there (with --target, beside the image's own packages) when that folder is carried:
#
#     bash fastpath/gpu_wheels.sh            # here, where PyPI is reachable (about 25 MB)
#     # then carry .gpu_cache/wheels in the call that runs: bash fastpath/gpu_check.sh OUT.json suite
set -euo pipefail
cd "$(dirname "$0")/.."
# what the suite imports (the first line), and what those require on Python 3.12 on Linux at this machine's
# versions, walked through their metadata, less what the image already holds (attrs, markdown-it-py, mdurl,
# psutil, pyyaml, jinja2, packaging, pygments, python-dateutil, typing-extensions, numpy, tqdm, ...)
names="nbformat nbclient ipykernel jupytext ruff gguf pytest-xdist execnet
traitlets jupyter_core jupyter_client pyzmq tornado comm nest-asyncio2 debugpy ipython jedi parso prompt_toolkit
wcwidth stack_data executing asttokens pure_eval decorator matplotlib-inline pexpect ptyprocess mdit-py-plugins
jsonschema jsonschema-specifications referencing rpds-py fastjsonschema platformdirs backcall pickleshare"
pins=$(python - $names <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
out = []
for name in sys.argv[1:]:
    try:
        out.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        # not needed by this machine's versions (backcall: older IPython)
        print(f"gpu_wheels: {name} is not installed here, skipped", file=sys.stderr)
print(" ".join(out))
PY
)
mkdir -p .gpu_cache/wheels
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .gpu_cache/wheels $pins
echo "gpu_wheels: $(ls .gpu_cache/wheels | wc -l) wheels, $(du -sh .gpu_cache/wheels | cut -f1), in .gpu_cache/wheels"
