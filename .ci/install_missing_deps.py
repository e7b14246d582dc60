"""Install the kvplane runtime dependencies a venv lacks, and nothing else.

Run with the venv's python from the repo root (.ci/setup-20 and setup-40 do): what the venv
already has (vLLM's or the engines' pins) is never upgraded; only missing packages are installed.
"""

import importlib.util
import subprocess
import sys

import tomllib

IMPORT_NAME = {"pyzmq": "zmq", "prometheus-client": "prometheus_client"}


def main() -> None:
    with open("pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    missing = []
    for spec in deps:
        name = spec.split(">")[0].split("=")[0].split("<")[0].strip()
        if importlib.util.find_spec(IMPORT_NAME.get(name, name.replace("-", "_"))) is None:
            missing.append(spec)
    if missing:
        print(f"{sys.argv[1] if len(sys.argv) > 1 else 'setup'}: installing", missing)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *missing])


if __name__ == "__main__":
    main()
