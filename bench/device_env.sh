# Sourced by the bench/*gpu*.sh scripts from the repository root (`source bench/device_env.sh ||
# exit 1`): installs the wheels carried in .whl/ (git-ignored: fastapi, uvicorn, pydantic, pyzmq,
# msgspec..., which GPU boxes may lack; see the device README) into a fresh folder outside the
# system packages, and puts that folder and the repository on PYTHONPATH. Returns 1 only when
# wheels are there and do not install. NO_WHEELS=1 skips them (a dev box with its own venv).
PY=${PYTHON:-python3}
QS_SITE=""
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
    QS_SITE=$(mktemp -d -t qs-site.XXXXXX)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$QS_SITE" .whl/*.whl || return 1
fi
export PYTHONPATH="${QS_SITE:+$QS_SITE:}$PWD${PYTHONPATH:+:$PYTHONPATH}"
