"""asyncslab's tests: shared helpers in ``tests.helpers``, hand-crafted malformed files in
``tests.malformed``; the servers, fault helpers and model writers they share with the
benchmarks are in ``support``."""
