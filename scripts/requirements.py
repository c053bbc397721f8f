"""Print the project's requirements, with the given extras, one per line (for pip -r).

usage: python scripts/requirements.py pyproject.toml cpu,test
"""

import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import pip._vendor.tomli as tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = [e for e in sys.argv[2].split(",") if e]
print("\n".join([*project["dependencies"], *(d for e in extras for d in project["optional-dependencies"][e])]))
