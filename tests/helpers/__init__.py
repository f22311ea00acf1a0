"""What several test folders share: the shipped test data, serial reference implementations, scripted
servers and episodes, and fixtures. Import as ``from tests.helpers.testdata import qwen_tokenizer_dir``; the
repository root is on ``sys.path`` under pytest (``tests`` is a package, so pytest's rootdir insertion puts it
there) and for ``python -m`` from the root."""
