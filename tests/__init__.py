"""ckptstore's test suite, a package so that its modules (and the functions ``tests.helpers.dist``
spawns on other ranks) import by one name everywhere: ``tests.<room>.test_<module>``."""
