"""CPU platform code in one place: the C++ kernels beside this file, their build, load and
wrappers (ops), CPU attention (attention), the allocator and huge pages (malloc) and thread counts
(threads)."""
