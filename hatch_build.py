"""Keeps .gitignore out of the sdist: hatchling copies it in whenever the project has one."""

from __future__ import annotations

import os
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        build_data["force_include"].pop(os.path.join(self.root, ".gitignore"), None)
