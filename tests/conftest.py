import os
import sys

# Test helpers (scenarios.py), the examples and scripts import by name, here and in the
# rank processes, which unpickle module-level functions by their module's name.
HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))
