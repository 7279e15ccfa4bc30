"""The proxy the course hub starts: JupyterHub's ConfigurableHTTPProxy, checking
the address it is about to listen on, once every setting is in.

hub_settings.py checks COURSE_HUB_URL while JupyterHub reads the configuration
file, but JupyterHub applies its command line after that file (traitlets'
``Application.load_config_file`` merges ``cli_config`` last, "to preserve CLI
config priority"), so ``jupyterhub -f deploy/jupyterhub_config.py --url
http://0.0.0.0:8000`` replaced that address after the check and put the trial
mode's any-password login on every interface. (``--ip`` and ``--port`` reach
``bind_url`` only through ``JupyterHub._url_part_changed``, which runs while
the command line is parsed, before the file sets ``bind_url``; applied again
after the file they are unchanged and change nothing: tests/test_hub_exposure.py.)
``JupyterHub.init_proxy`` builds the proxy with the final ``bind_url`` and TLS
files, after the hub's own address is set (``init_hub``) and before any port
opens (``JupyterHub.start``): the check is made here, on what the proxy will
really be given, whichever option or file set it. (jupyterhub 6.1.1, ``app.py``.)

Its ``start`` is also where the managed services' tokens of earlier hub starts
are revoked (service_tokens.py): in ``JupyterHub.start`` it runs after this
start's tokens are made and before any service starts, with the database open.
"""
import hub_settings
import service_tokens
from jupyterhub.proxy import ConfigurableHTTPProxy
from traitlets import Unicode


class CourseProxy(ConfigurableHTTPProxy):
    course_mode = Unicode("class", help="COURSE_HUB_MODE, which decides which addresses "
                          "are allowed (hub_settings.address_refusals)").tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        problems = hub_settings.address_refusals(self.course_mode, self.public_url,
                                                 bool(self.ssl_cert and self.ssl_key),
                                                 self.hub.bind_url)
        if problems:
            message = (f"The course hub will not start (COURSE_HUB_MODE={self.course_mode}) "
                       "on the address it was given in the end, command-line options "
                       "included:\n" + "\n".join(f"  - {p}" for p in problems))
            # printed as it is (JupyterHub logs an Exception's traceback)
            raise SystemExit(message)

    async def start(self):
        """Before any managed service starts: their tokens of earlier starts are revoked."""
        gone = service_tokens.revoke_stale(self.db, self.app._service_map)
        if gone:
            self.log.info("revoked %d token(s) of managed services of an earlier start", gone)
        return await super().start()
