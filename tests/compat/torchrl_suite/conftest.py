"""The vendored TorchRL tests are not the project's tests: they run through run.py (tests/test_compat_torchrl_suite.py),
in their own pytest process, after generate.py has added ArrowbufStorage to them."""

collect_ignore = ["upstream", "generate.py", "run.py", "report_plugin.py"]
