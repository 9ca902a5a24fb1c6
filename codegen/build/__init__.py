"""Building and keeping compiled code: the signed disk cache and its key, the loop kernels plans
share, driver builds in a child process, and the progress lines of long first calls."""
