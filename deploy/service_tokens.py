"""A managed service's API token lives as long as the service it was made for.

JupyterHub (6.1.1, ``JupyterHub.init_services``) makes a new token for a
managed service at every start and keeps every earlier one ("TODO: revoke old
tokens?"): the token of a crashed hub's idle culler, a role that may stop any
server, was still accepted by the restarted hub. `revoke_stale` deletes every
token of each managed service but the one this start made. It runs from the
course proxy's start (course_proxy.py): in ``JupyterHub.start`` that comes
after the services' new tokens are made and before any service starts.
"""
from jupyterhub import orm


def revoke_stale(db, services):
    """Delete the tokens of managed services (name -> jupyterhub Service) that are
    not their current one; the number deleted."""
    deleted = 0
    for service in services.values():
        if not service.managed or service.orm is None or not service.api_token:
            continue
        current = orm.APIToken.find(db, service.api_token)
        for token in list(service.orm.api_tokens):
            if current is None or token.id != current.id:
                db.delete(token)
                deleted += 1
    db.commit()
    return deleted
