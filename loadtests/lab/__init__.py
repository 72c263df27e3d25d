"""The lab: benchmarks and measurement harnesses that drive the product's internals in-process
(engine, scheduler, executor, kernels). They may import anything of the product; nothing of the
product imports them. One entry point, `hipfire-bench`, runs each of them."""
