"""The admin section's banner: when its tables are not the limits in force, every page of it says so.

With the settings source (the default) or a project's own, the tiers, endpoint policies,
assignments, overrides and fleet settings edited in the admin are kept but enforce nothing. An
operator who edits a tier there and sees nothing happen has been misled: each page of the
section carries the banner, with a link to the limits in force.
"""

from __future__ import annotations

from typing import Any

from django import template

from ..conf import Policies, conf
from ..exceptions import ConfigurationError
from ..policies.settings import SettingsPolicySource
from ..policies.source import get_policy_source
from ..store.database import DatabasePolicySource

register = template.Library()


@register.inclusion_tag("admin/ratelimits/includes/source_banner.html")
def policy_source_banner() -> dict[str, Any]:
    """Whether the banner shows, and which source is enforced instead of the tables."""
    try:
        source = get_policy_source()
    except ConfigurationError as exc:  # the settings cannot be read: nothing is enforced from the tables either
        return {"shown": True, "broken": str(exc), "field": Policies.source.field}
    if isinstance(source, DatabasePolicySource):
        return {"shown": False}
    return {
        "shown": True,
        "settings": isinstance(source, SettingsPolicySource),
        "source": conf.policies.source,
        "field": Policies.source.field,
    }
