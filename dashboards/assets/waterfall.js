/* The waterfall of one request, drawn in the browser from figure JSON the server sends for a
 * key (callbacks.WATERFALL_ROUTE). Pointing at a request in the breakdown for a moment fetches
 * its figure ahead, so the click that follows draws at once: no round trip on the click path,
 * and no wait for Dash either. The click draws the fetched figure, then after the next frame
 * selects the request in the dropdown (dash_clientside.set_props), whose callbacks fetch the
 * text beside it and leave the drawn waterfall as it is (Dash copies a callback's figure, so
 * setting it again would draw it twice; the graph's figure prop stays the one before, which
 * nothing reads and the next selection replaces). Dash calls the functions below as clientside
 * callbacks (callbacks.register); bench/dashboard_render.py times a click. */
(function () {
    const BREAKDOWN = 'breakdown-graph', WATERFALL = 'waterfall-graph';  // ids.py
    const REQUEST = 'request-dropdown';
    const CACHED = 32;  // figures kept, the most recently used
    const REST_MS = 80;  // the pointer rests this long on a request before its figure is fetched
    const cache = new Map();  // key -> Promise of the figure JSON, oldest first
    let resting = null;
    let shown = null;  // the key of the request the waterfall shows

    function route() {
        const config = JSON.parse(document.getElementById('_dash-config').textContent);
        return config.requests_pathname_prefix + '_kvscope/waterfall?key=';
    }

    function figureOf(key) {
        let figure = cache.get(key);
        if (figure) {
            cache.delete(key);  // most recently used last
        } else {
            figure = fetch(route() + encodeURIComponent(key)).then(response => {
                if (!response.ok) {
                    throw new Error(`waterfall of ${key}: HTTP ${response.status}`);
                }
                return response.json();
            }).then(fig => {
                figure.value = fig;  // drawable at once from now on
                return fig;
            });
            figure.catch(() => cache.delete(key));  // a failed fetch is retried next time
        }
        cache.set(key, figure);
        while (cache.size > CACHED) {
            cache.delete(cache.keys().next().value);
        }
        return figure;
    }

    function keyOf(event) {  // the request a breakdown hover or click is on (its first component)
        const points = (event && event.points) || [];
        const hit = points.find(p => p.customdata);
        return hit ? hit.customdata[0] : null;
    }

    function plot(id) {  // the Plotly div inside a dcc.Graph, once it has drawn
        const gd = document.querySelector(`#${id} .js-plotly-plot`);
        return gd && gd._fullLayout ? gd : null;
    }

    function select(key) {  // a click on the breakdown: its waterfall first, then Dash
        const figure = cache.get(key), gd = plot(WATERFALL);
        const choose = () => window.dash_clientside.set_props(REQUEST, {value: key});
        if (!(figure && figure.value && gd)) {
            choose();  // not fetched yet: the waterfall callback fetches and draws it
            return;
        }
        // the layout copied as dcc.Graph does: Plotly writes ranges into the one it gets
        Plotly.react(gd, {data: figure.value.data,
                          layout: JSON.parse(JSON.stringify(figure.value.layout))});
        shown = key;
        // the dropdown, the text beside it and their renders after the frame that shows it
        requestAnimationFrame(() => setTimeout(choose));
    }

    // The breakdown has clickmode "none" (figures.build_breakdown): Plotly neither recomputes
    // its hover nor emits plotly_click, so Dash has no clickData to process before the frame.
    // A click is a mousedown on it and a click event within 3 px, on the request its hover
    // shows (a drag is a zoom).
    let down = null;
    function listen() {  // once per breakdown plot: it is there before anything is hovered
        const gd = plot(BREAKDOWN);
        if (gd && !gd.kvscopeClick) {
            gd.kvscopeClick = true;
            gd.addEventListener('mousedown', e => {
                down = {x: e.clientX, y: e.clientY, gd: gd};
            }, true);
        }
    }
    document.addEventListener('click', e => {
        const start = down;
        down = null;
        if (start && Math.hypot(e.clientX - start.x, e.clientY - start.y) <= 3) {
            const key = keyOf({points: start.gd._hoverdata});
            if (key) {
                select(key);
            }
        }
    }, true);

    window.dash_clientside = Object.assign({}, window.dash_clientside, {
        kvscope: {
            // hoverData -> nothing: fetch the figure of the request the pointer rests on
            prefetch: function (hover) {
                listen();
                clearTimeout(resting);
                const key = keyOf(hover);
                if (key) {
                    resting = setTimeout(() => figureOf(key).catch(() => {}), REST_MS);
                }
                return window.dash_clientside.no_update;
            },
            // the request dropdown's value, once changed -> the waterfall's figure (the
            // page's layout holds the first request's: no fetch at page load)
            waterfall: function (key) {
                if (key && key === shown) {
                    return window.dash_clientside.no_update;  // drawn by the click already
                }
                shown = key;
                return figureOf(key || '');
            },
        },
    });
})();
