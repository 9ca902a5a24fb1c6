import os

# The verifier runs after every pass in tests.
os.environ.setdefault("BACKPLAN_VERIFY", "1")
