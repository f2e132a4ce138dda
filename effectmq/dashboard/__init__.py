"""The web dashboard: `effectmq dashboard --url ...` (needs the `dashboard` extra).

    from effectmq.dashboard import DashboardConfig, create_app
    app = create_app(DashboardConfig(url="redis://localhost:6379/0"))   # an aiohttp Application

Layout: `views` (pure: what pages and the API show, the hiding rules of sensitive
queues, how action outcomes read), `auth` (pure: who may act), `service` (every Redis
call; which queues a Redis holds is effectmq.client.discovery's), `web` (routes, templates, JSON).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .service import DashboardConfig

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["DashboardConfig", "create_app"]


def create_app(config: DashboardConfig) -> "web.Application":
    from .web import create_app as make  # aiohttp and jinja2 only when a dashboard is made

    return make(config)
