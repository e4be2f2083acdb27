"""Templates and images: which warm-up and which image a sandbox of a template runs, and what uses them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from warmbox import backends, config
from warmbox.config import PoolConfig, Template
from warmbox.errors import TemplateMismatch, TemplateNotFound
from warmbox.models import ImageRef, TemplateInfo, Tenant

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine

# engine.images and templates.builtins are imported where used: they pull in backends.runc, the
# microVM image code and the built-in templates (~7 ms, python -X importtime), which a process that
# only connects to sandboxes never needs.


def template(engine: Engine, name: str, tenant: Tenant | None = None) -> Template:
    """The template ``name`` as a warm-up: one of warmbox.toml's (built-in ones included) or a
    built template's (its recorded warm-up). InvalidArgument naming the known ones if neither."""
    settings = engine.settings()
    if name in settings.templates:
        return settings.template(name)
    info = built_template(engine, name, None, tenant)
    if info is None:
        from warmbox.templates.builtins import builtin

        b = builtin(name)
        if b is not None and b.spec is not None:  # a built-in built on top of base (browser)
            raise TemplateNotFound(
                f"the built-in template {name!r} is not built in this home yet: warmbox template build "
                f"{name} (its layers stay in the host's cache: seconds after scripts/bootstrap install)",
                template=name,
            )
        return settings.template(name)  # InvalidArgument: unknown template
    return Template(
        name=info.name,
        warmup_code=info.warmup_code,
        warmup_commands=info.warmup_commands,
        description=info.description,
    )


def built_template(engine: Engine, name: str, version: int | None, tenant: Tenant | None) -> TemplateInfo | None:
    """The registry's record of a built template (latest, or ``version``), the tenant's own
    first, then the host's; None if there is none."""
    for owner in dict.fromkeys([tenant.name if tenant is not None else "", ""]):
        try:
            return engine.registry.templates.template_get(name, version, tenant=owner)
        except TemplateNotFound:
            continue
    return None


def image_for(engine: Engine, template_name: str, tenant: Tenant | None = None, *, build: bool = True) -> ImageRef:
    """The image a new sandbox of ``template_name`` runs: a built template's latest version, else
    (a built-in template, or a warm-up-only one of warmbox.toml) the built-in image, built first
    if this host has none yet (minutes, once: scripts/bootstrap install does it ahead; ``build``
    False: TemplateNotFound instead)."""
    from warmbox.engine import images
    from warmbox.templates.builtins import builtin

    info = built_template(engine, template_name, None, tenant)
    if info is not None:
        return images.image_ref(info, engine.settings().cluster.object_store)
    spec = builtin(template_name)
    settings = engine.settings()
    if (spec is not None and spec.spec is not None) or (
        template_name in settings.templates and settings.template(template_name).build is not None
    ):  # a template with a build of its own runs only once built, never the built-in image instead
        raise TemplateNotFound(
            f"template {template_name!r} is not built yet: warmbox template build {template_name}",
            template=template_name,
        )
    template(engine, template_name, tenant)  # InvalidArgument for an unknown name
    return images.builtin_image(template_name, build=build)


def image_id_for(engine: Engine, template_name: str, tenant: Tenant | None = None) -> str | None:
    """The id of the image a new sandbox of ``template_name`` runs (what image_for's ImageRef would
    carry), from its record alone: no layer is looked up. None while the built-in image is not
    built (image_for builds it)."""
    from warmbox.engine import images

    info = built_template(engine, template_name, None, tenant)
    if info is not None:
        return info.image_id
    return images.builtin_image_id()


def recorded_image(
    engine: Engine, template_name: str, version: int, image_id: str, tenant: Tenant | None = None
) -> ImageRef:
    """The image a snapshot recorded (restore, resume, fork): that very image, never the
    template's latest. TemplateMismatch when it is gone (its template version removed, or its
    layers collected); CorruptLayer when a layer fails its digest. A snapshot from before
    images were recorded (``image_id`` "") gets the template's current image."""
    from warmbox import images as builtin
    from warmbox.engine import images

    if not image_id:
        return image_for(engine, template_name, tenant)
    if version == builtin.BUILTIN_VERSION:
        current = images.builtin_image(template_name)
        return current if current.image_id == image_id else images.builtin_by_id(template_name, image_id)
    info = built_template(engine, template_name, version, tenant)
    if info is None or info.image_id != image_id:
        raise TemplateMismatch(
            f"this snapshot ran template {template_name!r} version {version} (image {image_id}), which "
            + ("no longer exists" if info is None else f"now names another image ({info.image_id})"),
            template=template_name,
        )
    return images.image_ref(info, engine.settings().cluster.object_store)


def pool_shape(engine: Engine, pc: PoolConfig, *, build: bool = True) -> str:
    """The shape key of pool ``pc``'s sandboxes: tier, template, limits and the image its
    template has now (a rebuilt template: a new shape, the old sandboxes retire)."""
    tier = backends.canonical_tier(pc.tier)
    # a tier without images (Capabilities.images): its shape names none, as create_pooled makes it
    images = engine.backend(tier).capabilities().images
    image_id = image_for(engine, pc.template, build=build).image_id if images else ""
    return config.shape_key(tier, template(engine, pc.template), pc.limits, image_id)


def template_users(engine: Engine, name: str, version: int | None = None, tenant: Tenant | None = None) -> list[str]:
    """What uses template ``name`` (``version``, or any): ids of its sandboxes that are not
    destroyed (paused ones too), names of pools keeping its sandboxes or configured with it
    (when ``version`` is its latest or None), and ids of snapshots taken of its sandboxes.
    A template with users cannot be removed (TemplateInUse)."""
    owner = tenant.name if tenant is not None else ""
    sandboxes, pools, snaps = engine.registry.templates.template_users(name, version, owner)
    latest = built_template(engine, name, None, tenant)
    if not owner and (version is None or (latest is not None and latest.version == version)):
        pools = sorted({*pools, *(p.name for p in engine.settings().pools.values() if p.template == name)})
    return [*sandboxes, *pools, *snaps]
