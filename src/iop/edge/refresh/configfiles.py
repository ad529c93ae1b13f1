"""Reading a config file for a refresh: which files, what kind, how much, and never stuck.

`POST /refresh` may name a file (`path`), and SIGHUP re-reads the Edge's own. A path from a
request must not turn the admin API into a file reader: only the file the Edge was started from,
or a file inside `edge.admin.config_dir`, is read (symlinks resolved first, so a link in the
directory to a file outside it is refused). A named file must also be a regular file no larger
than `MAX_FILE_BYTES`: it is opened without blocking (`O_NONBLOCK`) and checked before a byte is
read, so a FIFO or a device can neither hang the thread that reads it (and every later refresh
with it) nor stop the process from exiting. Refusals say what is wrong with the path, never
what the file holds.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

#: Largest config file read (the config loader refuses larger text anyway).
MAX_FILE_BYTES: Final = 8 * 1024 * 1024


class ConfigFileRefused(ValueError):
    """A path a refresh may not read; the message names the path's problem, never content."""


@dataclass(frozen=True, slots=True)
class ConfigFiles:
    """The files a refresh may read: the Edge's own config file and those in `directory`."""

    own: Path | None = None
    directory: Path | None = None

    def check(self, requested: str | Path) -> Path:
        """The real path of `requested` when a refresh may read it; else `ConfigFileRefused`.

        Resolves symlinks (a few `lstat` calls): run it off the event loop with `read`.
        """
        text = str(requested)
        if "\x00" in text:
            raise ConfigFileRefused("the path contains a NUL byte")
        if not text:
            raise ConfigFileRefused("the path is empty")
        path = Path(text)
        if not path.is_absolute():
            if self.directory is None:
                raise ConfigFileRefused(
                    f"{text}: give an absolute path (relative ones are taken in "
                    "edge.admin.config_dir, which is not set)"
                )
            path = self.directory / path
        real = Path(os.path.realpath(path))
        if self.own is not None and real == Path(os.path.realpath(self.own)):
            return real
        if self.directory is not None and real.is_relative_to(os.path.realpath(self.directory)):
            return real
        allowed = "the Edge's own config file"
        if self.directory is not None:
            allowed += f" or a file in {self.directory} (edge.admin.config_dir)"
        else:
            allowed += " (set edge.admin.config_dir to allow the files of a directory)"
        raise ConfigFileRefused(f"{text}: a refresh reads only {allowed}")

    def read(self, requested: str | Path) -> str:
        """The text of an allowed, regular, small enough UTF-8 file. Blocking: run in a thread."""
        path = self.check(requested)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError as exc:
            raise ConfigFileRefused(f"{requested}: cannot open: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ConfigFileRefused(f"{requested}: not a regular file")
            if info.st_size > MAX_FILE_BYTES:
                raise ConfigFileRefused(f"{requested}: larger than {MAX_FILE_BYTES} bytes")
            with os.fdopen(os.dup(fd), "rb") as file:
                data = file.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigFileRefused(f"{requested}: cannot read: {exc.strerror}") from None
        finally:
            os.close(fd)
        if len(data) > MAX_FILE_BYTES:
            raise ConfigFileRefused(f"{requested}: larger than {MAX_FILE_BYTES} bytes")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigFileRefused(f"{requested}: not UTF-8 text") from None
