import os
import sys

# The package is used from the source tree (pure Python, nothing to build).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
